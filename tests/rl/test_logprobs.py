"""Chunked per-token log-probs and entropy == the naive full-logits computation, without its memory."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.rl.logprobs import token_logprobs
from jgrpo.sampling.methods import SamplingMethod


def _temperature_top_k(temperature, k):
    """Independent of the sampler: divide by the temperature, keep the k largest logits, renormalise."""

    def process(logits):
        scaled = logits / temperature
        kth = jax.lax.top_k(scaled, k)[0][..., -1:]
        return jax.nn.log_softmax(jnp.where(scaled >= kth, scaled, -jnp.inf), axis=-1)

    return process


def _naive(hidden, unembedding, targets, process=None):
    """All [B, T, V] logits at once."""
    logits = jnp.einsum("btd,dv->btv", hidden.astype(jnp.float32), unembedding.astype(jnp.float32))
    logp = jax.nn.log_softmax(logits, axis=-1) if process is None else process(logits)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.where(p > 0, logp, 0.0), 0.0), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], entropy


def _inputs(b=2, t=7, d=6, v=13, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k[0], (b, t, d)), jax.random.normal(k[1], (d, v)),
            jax.random.randint(k[2], (b, t), 0, v))


def test_hand_numbers_uniform_and_top_k():
    # Zero hidden state -> all logits 0 -> uniform over V = 4: log-prob -ln 4, entropy ln 4.
    # With top-2 truncation of the logits [0, 1, 2, 3] at temperature 1: support {2, 3}, probabilities
    # e^2/(e^2+e^3), e^3/(e^2+e^3); token 0 is outside the support -> -inf.
    hidden = jnp.zeros((1, 3, 2))
    lp, ent = token_logprobs(hidden, jnp.ones((2, 4)), jnp.array([[0, 1, 3]]), chunk=2)
    np.testing.assert_allclose(lp, np.full((1, 3), -math.log(4)), rtol=1e-6)
    np.testing.assert_allclose(ent, np.full((1, 3), math.log(4)), rtol=1e-6)
    hidden = jnp.ones((1, 2, 1))
    unembedding = jnp.array([[0.0, 1.0, 2.0, 3.0]])
    top2 = _temperature_top_k(1.0, 2)
    lp, ent = token_logprobs(hidden, unembedding, jnp.array([[3, 0]]), chunk=1, process_logits=top2)
    p3 = math.exp(3) / (math.exp(2) + math.exp(3))
    np.testing.assert_allclose(lp[0, 0], math.log(p3), rtol=1e-6)
    assert lp[0, 1] == -np.inf
    np.testing.assert_allclose(ent[0], -(p3 * math.log(p3) + (1 - p3) * math.log(1 - p3)), rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])  # 3 does not divide T = 7; 16 exceeds it
@pytest.mark.parametrize(
    "process",
    [None, _temperature_top_k(0.7, 4), SamplingMethod(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05).process_logits],
    ids=["softmax", "temp0.7_top4", "sampler_method"],
)
def test_chunked_matches_naive_values_and_gradients(chunk, process):
    hidden, unembedding, targets = _inputs()
    if process is not None:  # keep every target inside the truncated support so all log-probs are finite
        logits = jnp.einsum("btd,dv->btv", hidden, unembedding)
        targets = jnp.argmax(logits, axis=-1)
    weights = jax.random.normal(jax.random.PRNGKey(9), (2, *targets.shape))

    def objective(fn):  # a scalar that depends on both outputs, to check both gradients
        def f(h, u):
            lp, ent = fn(h, u)
            return jnp.sum(weights[0] * lp) + jnp.sum(weights[1] * ent)
        return jax.value_and_grad(f, argnums=(0, 1))

    chunked = lambda h, u: token_logprobs(h, u, targets, chunk=chunk, process_logits=process)
    naive = lambda h, u: _naive(h, u, targets, process)
    for got, want in zip(chunked(hidden, unembedding), naive(hidden, unembedding), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    (v_got, g_got), (v_want, g_want) = objective(chunked)(hidden, unembedding), objective(naive)(hidden, unembedding)
    np.testing.assert_allclose(v_got, v_want, rtol=1e-5)
    for a, b in zip(g_got, g_want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_targets_outside_the_support_are_finite_once_masked():
    # Real tokens are in the top-2 support (the argmax); the last two positions are "padding" whose target is
    # the least likely token, outside the support, so lp = -inf there. Masked out, value and gradients are finite.
    hidden, unembedding, _ = _inputs()
    logits = jnp.einsum("btd,dv->btv", hidden, unembedding)
    mask = jnp.ones(logits.shape[:2], bool).at[:, -2:].set(False)
    targets = jnp.where(mask, jnp.argmax(logits, -1), jnp.argmin(logits, -1))

    def f(h, u):
        lp, ent = token_logprobs(h, u, targets, chunk=3, process_logits=_temperature_top_k(1.0, 2))
        return jnp.sum(jnp.where(mask, lp, 0.0)) + jnp.sum(jnp.where(mask, ent, 0.0))

    lp, _ = token_logprobs(hidden, unembedding, targets, chunk=3, process_logits=_temperature_top_k(1.0, 2))
    assert np.all(lp[:, -2:] == -np.inf) and np.all(np.isfinite(lp[:, :-2]))
    value, grads = jax.value_and_grad(f, argnums=(0, 1))(hidden, unembedding)
    assert np.isfinite(value) and all(np.all(np.isfinite(g)) for g in grads)


def test_bfloat16_inputs_give_float32_outputs():
    hidden, unembedding, targets = _inputs()
    lp, ent = token_logprobs(hidden.astype(jnp.bfloat16), unembedding.astype(jnp.bfloat16), targets, chunk=4)
    assert lp.dtype == jnp.float32 and ent.dtype == jnp.float32
    want_lp, _ = _naive(hidden.astype(jnp.bfloat16), unembedding.astype(jnp.bfloat16), targets)
    np.testing.assert_allclose(lp, want_lp, rtol=1e-4, atol=1e-4)


def test_full_logits_never_exist_in_compiled_memory():
    # B x T x V float32 logits are 2 * 256 * 4096 * 4 = 8 MiB; one chunk of 16 positions is 0.5 MiB.
    # The compiled forward+backward's temporaries must stay well under one copy of the full logits (measured:
    # ~2.2 MB, i.e. a few chunk-sized buffers: logits, probabilities, their cotangent), while the naive path
    # holds several full copies (~33.5 MB).
    b, t, d, v = 2, 256, 16, 4096
    hidden, unembedding = jnp.zeros((b, t, d)), jnp.zeros((d, v))
    targets = jnp.zeros((b, t), jnp.int32)

    def temp_bytes(fn):
        grad = jax.grad(lambda h, u: jnp.sum(sum(fn(h, u))), argnums=(0, 1))
        return jax.jit(grad).lower(hidden, unembedding).compile().memory_analysis().temp_size_in_bytes

    full_logits = b * t * v * 4
    chunked = temp_bytes(lambda h, u: token_logprobs(h, u, targets, chunk=16))
    naive = temp_bytes(lambda h, u: _naive(h, u, targets))
    assert naive >= full_logits  # the naive path does hold them
    assert chunked < full_logits / 2 and 8 * chunked < naive, (chunked, naive)


def test_bad_inputs_are_named():
    hidden, unembedding, targets = _inputs()
    with pytest.raises(ValueError, match=r"unembedding must be \[D, V\]"):
        token_logprobs(hidden, unembedding.T, targets, chunk=2)
    with pytest.raises(ValueError, match="targets must be"):
        token_logprobs(hidden, unembedding, targets[:, :3], chunk=2)
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        token_logprobs(hidden, unembedding, targets, chunk=0)


def test_bfloat16_compute_rounds_the_projection_exactly_as_the_sampler_does():
    # float32 params, bfloat16 compute: the sampler's logits (LLM.logits) cast the unembedding to bf16; the
    # trainer used to multiply the bf16 hidden state by the float32 unembedding (promoted to float32), so the
    # same hidden state gave other log-probs on the two sides (~1e-2 here). One function now does both.
    hidden, unembedding, targets = _inputs(b=3, t=5, d=64, v=97, seed=3)
    hidden = (4 * hidden).astype(jnp.bfloat16)
    # The sampler's rounding: both operands in bf16, float32 accumulation.
    logits = jnp.einsum("btd,dv->btv", hidden, unembedding.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    sampler_lp = jax.nn.log_softmax(logits, axis=-1)
    sampler_lp = jnp.take_along_axis(sampler_lp, targets[..., None], -1)[..., 0]
    lp, _ = token_logprobs(hidden, unembedding, targets, chunk=5)
    np.testing.assert_allclose(lp, sampler_lp, rtol=0, atol=1e-6)
