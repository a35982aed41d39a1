"""LoRA adapters on the model (`jgrpo.models.lora`): exact at init, equal to hand-merged weights, sharded like
their base weights, and seen identically by the sampler and the trainer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jgrpo.config import MeshConfig
from jgrpo.models.llm import LLM, LLMConfig, forward, param_logical_axes, position_ids_from_mask, split_model
from jgrpo.models.lora import LORA_TARGETS, join_adapters, merge_adapters, split_adapters
from jgrpo.parallel.mesh import SAMPLE_RULES, TRAIN_RULES, make_mesh, place, row_sharding
from jgrpo.rl.logprobs import token_logprobs
from jgrpo.sampling.sampler import SamplingMethod
from tests.helpers import generate

BASE = LLMConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8, architecture="qwen2", qkv_bias=True)
RANK, ALPHA = 4, 8.0
LORA = dataclasses.replace(BASE, lora_rank=RANK, lora_alpha=ALPHA, lora_targets=LORA_TARGETS)


@pytest.fixture(scope="module")
def lora_model():
    """(graphdef, params) of the LoRA model with every B random (non-zero), and the base graphdef."""
    graphdef, params = split_model(LLM(LORA, rngs=nnx.Rngs(params=3)))
    keys = iter(jax.random.split(jax.random.key(7), 16))
    layers = {k: (0.3 * jax.random.normal(next(keys), v.shape) if k.endswith("_lora_b") else v)
              for k, v in params["layers"].items()}
    base_graphdef, _ = split_model(LLM(BASE, rngs=nnx.Rngs(params=0)))
    return graphdef, {**params, "layers": layers}, base_graphdef


def _batch():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, BASE.vocab_size, (3, 7)), jnp.int32)
    mask = jnp.asarray(np.arange(7)[None, :] >= np.array([[0], [2], [5]]))
    return tokens, position_ids_from_mask(mask), mask


def _logits(graphdef, params):
    tokens, positions, mask = _batch()
    hidden, _ = forward(graphdef, params, tokens, positions, mask)
    model = nnx.merge(graphdef, params)
    return np.asarray(model.logits(hidden))


def test_a_fresh_adapter_changes_nothing():
    graphdef, params = split_model(LLM(LORA, rngs=nnx.Rngs(params=3)))
    assert all(not np.any(np.asarray(v)) for k, v in params["layers"].items() if k.endswith("_lora_b"))
    assert any(np.any(np.asarray(v)) for k, v in params["layers"].items() if k.endswith("_lora_a"))
    adapters, base = split_adapters(params)
    assert sorted(adapters["layers"]) == sorted(f"{t}_lora_{x}" for t in LORA_TARGETS for x in "ab")
    base_graphdef, _ = split_model(LLM(BASE, rngs=nnx.Rngs(params=0)))
    np.testing.assert_array_equal(_logits(graphdef, params), _logits(base_graphdef, base))


def test_adapters_equal_weights_merged_by_hand(lora_model):
    graphdef, params, base_graphdef = lora_model
    layers = params["layers"]
    # W + (alpha / r) A B by hand, for a 1-input projection (q: [L, D, H, Dh]) and the 2-input one (o: [L, H, Dh, D]).
    scale = ALPHA / RANK
    q = np.asarray(layers["q"]) + scale * np.einsum("ldr,lrhk->ldhk", layers["q_lora_a"], layers["q_lora_b"])
    o = np.asarray(layers["o"]) + scale * np.einsum("lhkr,lrd->lhkd", layers["o_lora_a"], layers["o_lora_b"])
    merged = merge_adapters(params, scale)
    np.testing.assert_allclose(merged["layers"]["q"], q, atol=1e-6)
    np.testing.assert_allclose(merged["layers"]["o"], o, atol=1e-6)
    assert not any(k.endswith(("_lora_a", "_lora_b")) for k in merged["layers"])
    lora_logits, merged_logits = _logits(graphdef, params), _logits(base_graphdef, merged)
    assert np.abs(lora_logits - _logits(base_graphdef, split_adapters(params)[1])).max() > 1e-2  # adapters matter
    np.testing.assert_allclose(lora_logits, merged_logits, atol=1e-5, rtol=0)


def test_split_and_join_are_inverse_without_copies(lora_model):
    _, params, _ = lora_model
    adapters, base = split_adapters(params)
    joined = join_adapters(adapters, base)
    assert jax.tree.structure(joined) == jax.tree.structure(params)
    assert all(a is b for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(params), strict=True))


@pytest.mark.parametrize("rules", [TRAIN_RULES, SAMPLE_RULES], ids=["train", "sample"])
def test_adapters_shard_like_their_base_weights(lora_model, rules):
    graphdef, params, _ = lora_model
    axes = param_logical_axes(params)["layers"]
    assert axes["q_lora_a"] == P("layers", "embed", "lora_rank")
    assert axes["q_lora_b"] == P("layers", "lora_rank", "heads", "head_dim")
    assert axes["o_lora_a"] == P("layers", "heads", "head_dim", "lora_rank")
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = place(params, param_logical_axes(params), mesh, rules)
    embed = "fsdp" if rules is TRAIN_RULES else None
    assert sharded["layers"]["gate_lora_a"].sharding.spec == P(None, embed, None)
    assert sharded["layers"]["gate_lora_b"].sharding.spec == P(None, None, "tensor")
    assert sharded["layers"]["down_lora_a"].sharding.spec == P(None, "tensor", None)
    tokens, positions, mask = _batch()
    expected, _ = jax.jit(forward, static_argnums=0)(graphdef, params, tokens, positions, mask)
    data = row_sharding(mesh, rules, (4, 7))
    pad = lambda x: jax.device_put(jnp.concatenate([x, x[:1]]), data)  # noqa: E731 - 4 rows divide the batch axes
    got, _ = jax.jit(forward, static_argnums=0)(graphdef, sharded, pad(tokens), pad(positions), pad(mask))
    np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(expected), atol=1e-5, rtol=0)


def test_sampler_logprobs_equal_the_trainers_with_adapters(lora_model):
    graphdef, params, _ = lora_model
    tokens, _, mask = _batch()
    method = SamplingMethod(temperature=0.9)
    out = generate(graphdef, params, tokens, mask, num_samples=2, max_new_tokens=6, method=method, stop_ids=(2,),
                   key=jax.random.key(1))
    full = jnp.concatenate([jnp.repeat(tokens, 2, 0), out.tokens], axis=1)
    full_mask = jnp.concatenate([jnp.repeat(mask, 2, 0), out.completion_mask], axis=1)
    model = nnx.merge(graphdef, params)
    hidden, _ = model(full, position_ids_from_mask(full_mask), full_mask)
    n_prompt, n_new = tokens.shape[1], out.tokens.shape[1]
    lp, _ = token_logprobs(hidden[:, n_prompt - 1:n_prompt + n_new - 1], model.unembedding(), out.tokens, chunk=3,
                           process_logits=method.process_logits)
    np.testing.assert_allclose(out.logprobs, np.where(out.completion_mask, lp, 0.0), atol=1e-4, rtol=0)


def test_bad_adapter_specs_are_named():
    with pytest.raises(ValueError, match="a positive rank needs targets"):
        dataclasses.replace(BASE, lora_rank=4)
    with pytest.raises(ValueError, match="each one of"):
        dataclasses.replace(BASE, lora_rank=4, lora_targets=("q", "qkv"))
    with pytest.raises(ValueError, match="alpha must be > 0"):
        dataclasses.replace(BASE, lora_rank=4, lora_alpha=0.0, lora_targets=("q",))
