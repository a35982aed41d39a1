"""Every `model.attention` implementation that runs on a CPU equals the plain softmax formula (values and
gradients, at the queries the model uses), alone, inside the model and on the 8-device mesh; `auto` resolves by
platform. (`cudnn` runs on NVIDIA GPUs only: benchmarks/accelerator.py exercises it there.)"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jgrpo.config import ConfigError, MeshConfig
from jgrpo.config.loading import load_config
from jgrpo.models.attention_backends import (
    causal_attention,
    cudnn_inputs,
    masked_attention,
    mesh_context,
    resolve_attention,
)
from jgrpo.models.llm import LLM, LLMConfig, merge_model, position_ids_from_mask, split_model
from jgrpo.parallel.mesh import make_mesh
from tests.helpers import reference_attention

ON_CPU = ("custom", "xla", "splash")  # splash in Pallas interpret mode


def _inputs(T, S, heads=4, kv_heads=2, Dh=16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(3, T, heads, Dh)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(3, S, kv_heads, Dh)), jnp.float32) for _ in range(2))
    # Left padding of 0, 2 and 5 slots, and (queries past S - T) completions that stop early.
    kv_valid = np.arange(S)[None, :] >= np.array([[0], [2], [5]])
    if S > T:
        kv_valid &= np.arange(S)[None, :] < S - np.array([[0], [3], [1]])
    allowed = (np.arange(S)[None, :] <= np.arange(T)[:, None] + S - T)[None] & kv_valid[:, None, :]
    return q, k, v, jnp.asarray(kv_valid), jnp.asarray(allowed), kv_valid[:, S - T:]


def _equals_the_formula(attend, q, k, v, allowed, seen):
    """attend(q, k, v) equals the softmax formula under `allowed` at the queries `seen` [B, T] (values, and the
    gradients of a loss on them), and is finite everywhere (padding queries too)."""
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape) * seen[..., None, None], jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    ours = jax.jit(attend)
    reference = lambda q, k, v: reference_attention(q, k, v, allowed)  # noqa: E731
    out = ours(q, k, v)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(reference(q, k, v))[seen], atol=2e-6)
    grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    expected = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", grads, expected, strict=True):
        assert bool(jnp.all(jnp.isfinite(a)))
        np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("implementation", ON_CPU)
@pytest.mark.parametrize(("T", "S"), [(9, 9), (6, 13), (130, 194)], ids=["self", "prompt_then_causal", "padded"])
def test_values_and_gradients_match_the_softmax_formula(implementation, T, S):
    q, k, v, kv_valid, allowed, q_valid = _inputs(T, S)
    _equals_the_formula(lambda q, k, v: causal_attention(implementation, q, k, v, kv_valid), q, k, v, allowed, q_valid)


def _packed_masks(T, S):
    """Masks as the packed forward makes them, one per row: [prompt keys | the row's own keys], each completion
    segment seeing the prompt's real keys and itself causally; row 1 also holds padding queries that see nothing, row
    2 is empty (no allowed pair at all: a whole block of queries the kernel would skip)."""
    P = S - T
    mask = np.zeros((3, T, S), bool)
    for row, (prompt, cuts) in enumerate([(P, [0, 5, T]), (P - 2, [0, 3, T - 130 if T > 130 else T - 1])]):
        for a, b in itertools.pairwise(cuts):
            mask[row, a:b, :prompt] = True
            mask[row, a:b, P + a:P + b] = np.tril(np.ones((b - a, b - a), bool))
    return jnp.asarray(mask)


@pytest.mark.parametrize("implementation", ON_CPU)
@pytest.mark.parametrize(("T", "S"), [(9, 13), (300, 364)], ids=["small", "blocks_without_a_query"])
def test_a_mask_per_row_matches_the_softmax_formula(implementation, T, S):
    """`masked_attention` (the packed forward's) under masks only a per-row mask expresses; splash runs its
    dynamic-mask kernel. Queries that see nothing get a finite output (callers mask them) and send no gradient."""
    q, k, v, _, _, _ = _inputs(T, S)
    allowed = _packed_masks(T, S)
    _equals_the_formula(lambda q, k, v: masked_attention(implementation, q, k, v, allowed), q, k, v, allowed,
                        np.asarray(allowed).any(-1))


def test_splash_with_a_mask_per_row_on_the_mesh_is_placed_per_device():
    """The dynamic-mask kernel under shard_map: rows over data x fsdp, kv heads over tensor, each row's mask with it."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    q, k, v, _, _, _ = _inputs(9, 13, heads=4, kv_heads=2)
    q, k, v = (jnp.concatenate([x, x[:1]]) for x in (q, k, v))  # 4 rows: 2 x 2 row shards
    allowed = jnp.concatenate([_packed_masks(9, 13), _packed_masks(9, 13)[:1]])
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor"))
    placed = [jax.device_put(x, rows) for x in (q, k, v)]
    attend = jax.jit(lambda q, k, v, m: masked_attention("splash", q, k, v, m))
    with jax.set_mesh(mesh):
        lowered = attend.lower(*placed, allowed)
        got = attend(*placed, allowed)
    assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
    seen = np.asarray(allowed).any(-1)
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(reference_attention(q, k, v, allowed))[seen],
                               atol=2e-6)


@pytest.mark.parametrize(("T", "S"), [(9, 9), (6, 13), (7, 12), (8, 8)], ids=["both_odd", "kv_odd", "q_odd", "even"])
def test_cudnn_inputs_change_no_value_or_gradient(T, S):
    """The cuDNN path pads odd lengths (its training kernels refuse them with a mask) and lets a query that sees
    no key see key 0: run through XLA's attention (CPU has no cuDNN), the call on those inputs, cut back, equals
    the plain one at every real query, values and gradients."""
    q, k, v, _, allowed, q_valid = _inputs(T, S)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape) * q_valid[..., None, None], jnp.float32)

    def plain(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], implementation="xla")

    def padded(q, k, v):
        qp, kp, vp, mask = cudnn_inputs(q, k, v, allowed)
        assert qp.shape[1] % 2 == 0 and kp.shape[1] % 2 == 0 and mask.shape == (3, qp.shape[1], kp.shape[1])
        assert bool(jnp.all(jnp.any(mask, axis=-1)))  # every query sees a key, padding ones included
        return jax.nn.dot_product_attention(qp, kp, vp, mask=mask[:, None], implementation="xla")[:, :T]

    out = padded(q, k, v)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(np.asarray(out)[q_valid], np.asarray(plain(q, k, v))[q_valid], atol=2e-6)
    for name, a, b in zip("qkv", *(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * weights), argnums=(0, 1, 2))(
            q, k, v) for f in (padded, plain)), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"d{name}")


TINY = LLMConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8, qkv_bias=True)


def _model_batch():
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 64, (4, 11)), jnp.int32)
    mask = jnp.asarray(np.arange(11)[None, :] >= np.array([[0], [3], [6], [1]]))
    return tokens, mask, position_ids_from_mask(mask)


@pytest.mark.parametrize("implementation", ["xla", "splash"])
def test_model_forward_and_gradient_equal_the_custom_attention(implementation):
    graphdef, params = split_model(LLM(TINY, rngs=nnx.Rngs(params=2)))
    other, _ = split_model(LLM(dataclasses.replace(TINY, attention=implementation), rngs=nnx.Rngs(params=2)))
    tokens, mask, positions = _model_batch()

    def loss(graphdef):
        return lambda p: jnp.sum(jnp.where(mask[..., None], merge_model(graphdef, p)(tokens, positions, mask)[0], 0))

    expected = merge_model(graphdef, params)(tokens, positions, mask)[0]
    got = jax.jit(lambda p: merge_model(other, p)(tokens, positions, mask)[0])(params)
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(expected)[mask], atol=2e-5)
    g_expected, g_got = jax.grad(loss(graphdef))(params), jax.jit(jax.grad(loss(other)))(params)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_expected), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4 * float(jnp.max(jnp.abs(b))) + 1e-7)


def test_splash_on_the_mesh_is_placed_per_device():
    """Rows over data x fsdp and kv heads over tensor through shard_map (traced in the mesh context)."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    graphdef, params = split_model(LLM(dataclasses.replace(TINY, attention="splash"), rngs=nnx.Rngs(params=2)))
    custom, _ = split_model(LLM(TINY, rngs=nnx.Rngs(params=2)))
    tokens, mask, positions = _model_batch()
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    placed = [jax.device_put(x, rows) for x in (tokens, mask, positions)]
    forward = jax.jit(lambda p, t, m, pos: merge_model(graphdef, p)(t, pos, m)[0])
    with mesh_context(merge_model(graphdef, params).cfg, mesh):
        lowered = forward.lower(params, *placed)
        got = forward(params, *placed)
    assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
    expected = merge_model(custom, params)(tokens, positions, mask)[0]
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(expected)[mask], atol=2e-5)


def test_auto_resolves_by_platform_and_bad_choices_are_named():
    assert [resolve_attention("auto", p) for p in ("cpu", "tpu", "gpu")] == ["custom", "splash", "custom"]
    assert resolve_attention("xla", "tpu") == "xla"
    with pytest.raises(ValueError, match="model.attention must be auto or one of"):
        resolve_attention("flash", "cpu")
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, ["model.attention=flash"])
    with pytest.raises(ValueError, match="attention must be one of"):
        dataclasses.replace(TINY, attention="auto")
