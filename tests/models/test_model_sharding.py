"""The model sharded over the 8-device (data, fsdp, tensor) mesh computes what one device computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jgrpo.config import MeshConfig
from jgrpo.models.hf import export_hf, load_model
from jgrpo.models.llm import LLM, LLMConfig, forward, param_logical_axes, position_ids_from_mask, split_model
from jgrpo.parallel.mesh import SAMPLE_RULES, TRAIN_RULES, make_mesh, place, row_sharding

CFG = LLMConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=100000.0,
    architecture="qwen2",
    qkv_bias=True,
)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))


@pytest.fixture(scope="module")
def model():
    return split_model(LLM(CFG, rngs=nnx.Rngs(params=2)))


def _batch():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (4, 9)), jnp.int32)
    mask = jnp.asarray(np.arange(9)[None, :] >= np.array([[0], [3], [8], [5]]))
    return tokens, mask


def test_logical_axes_cover_every_param(model):
    _, params = model
    axes = param_logical_axes(params)
    assert axes["layers"]["q"] == P("layers", "embed", "heads", "head_dim")
    assert axes["embed"] == P("vocab", "embed")
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(params)


@pytest.mark.parametrize("rules", [TRAIN_RULES, SAMPLE_RULES], ids=["train", "sample"])
def test_sharded_forward_equals_single_device(model, mesh, rules):
    graphdef, params = model
    tokens, mask = _batch()
    expected, _ = jax.jit(forward, static_argnums=0)(graphdef, params, tokens, position_ids_from_mask(mask), mask)

    sharded = place(params, param_logical_axes(params), mesh, rules)
    q_spec = sharded["layers"]["q"].sharding.spec
    assert q_spec == P(None, "fsdp" if rules is TRAIN_RULES else None, "tensor", None)
    data = row_sharding(mesh, rules, tokens.shape)
    tokens, mask = jax.device_put(tokens, data), jax.device_put(mask, data)
    got, _ = jax.jit(forward, static_argnums=0)(graphdef, sharded, tokens, position_ids_from_mask(mask), mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)


def test_load_places_each_tensor_on_its_sharding(model, mesh, tmp_path):
    graphdef, params = model
    export_hf(params, CFG, None, tmp_path / "ckpt")
    _, loaded, cfg = load_model(str(tmp_path / "ckpt"), mesh=mesh, rules=TRAIN_RULES)
    assert cfg == CFG
    assert loaded["layers"]["gate"].sharding.spec == P(None, "fsdp", "tensor")
    assert loaded["embed"].sharding.spec == P("tensor", "fsdp")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), loaded, params)
