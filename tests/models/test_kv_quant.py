"""The int8 KV cache (`sampler.kv_cache_dtype: int8`, models/kv_quant.py): the round trip, the decode attention's
int8 read against attention over the dequantized cache, and the decode step (unrolled and scanned) against the
cached forward over the same int8 cache, token by token."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jgrpo.models import kv_quant
from jgrpo.models.decode import _attend_one, decode_cache, prompt_store
from jgrpo.models.llm import LLM, forward, init_cache, merge_model, position_ids_from_mask, split_model
from tests.models.test_model_cache import (
    CFG,  # 3 layers, 4 heads over 2 KV heads of 16, biases and qk-norm
    fed_one_token_at_a_time,
)


@pytest.fixture(scope="module")
def model():
    return split_model(LLM(CFG, rngs=nnx.Rngs(params=1)))


def test_round_trip_is_within_half_a_step_per_token_and_head_and_a_zero_vector_stays_zero():
    x = jax.random.normal(jax.random.key(0), (2, 3, 5, 16)) * jnp.asarray([0.01, 1.0, 300.0])[None, :, None, None]
    x = x.at[0, 0, 0].set(0.0)
    c = kv_quant.quantize_kv(x)
    assert c.values.dtype == jnp.int8 and c.scales.shape == (2, 3, 5, 1) and c.scales.dtype == jnp.float32
    back = kv_quant.dequantize_kv(c)
    assert np.all(np.abs(back - x) <= c.scales / 2 * (1 + 1e-6))
    np.testing.assert_allclose(c.scales, np.max(np.abs(x), -1, keepdims=True) / 127 + (x == 0).all(-1, keepdims=True))
    assert np.all(back[0, 0, 0] == 0) and c.scales[0, 0, 0, 0] == 1.0
    assert np.max(np.abs(c.values)) == 127  # each vector's largest element takes the full range


def test_an_int8_cache_array_cannot_be_indexed_as_a_tuple():
    c = kv_quant.quantize_kv(jnp.ones((2, 4)))
    with pytest.raises(TypeError):
        c[0]  # noqa: B018 - a NamedTuple would silently give the values


def test_int8_attention_equals_attention_over_the_dequantized_cache():
    keys = jax.random.split(jax.random.key(1), 5)
    B, KVH, G, Dh = 3, 2, 2, 16
    q = jax.random.normal(keys[0], (B, 1, KVH * G, Dh))
    segments = [(jax.random.normal(keys[1 + i], (B, KVH, n, Dh)) * 3, jax.random.normal(keys[3 + i], (B, KVH, n, Dh)))
                for i, n in enumerate((5, 4))]
    allowed = jnp.asarray(np.random.default_rng(0).random((B, 9)) < 0.7).at[:, 0].set(True)
    ks = tuple(kv_quant.quantize_kv(k) for k, _ in segments)
    vs = tuple(kv_quant.quantize_kv(v) for _, v in segments)
    int8 = _attend_one(q, ks, vs, allowed)
    dequantized = _attend_one(q, tuple(map(kv_quant.dequantize_kv, ks)), tuple(map(kv_quant.dequantize_kv, vs)),
                              allowed)
    np.testing.assert_allclose(int8, dequantized, atol=1e-5, rtol=0)
    exact = _attend_one(q, tuple(k for k, _ in segments), tuple(v for _, v in segments), allowed)
    assert 1e-4 < float(jnp.max(jnp.abs(int8 - exact))) < 0.1  # quantized, and close


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_segments_softmax_merged_by_log_sum_exp_equals_one_softmax_over_all_slots(int8):
    """`merged` (sampler.decode_softmax: segments): per-segment softmax merged by log-sum-exp == one softmax over
    the concatenated scores, with a segment no row may read, a row that may read one segment only, and a row
    that may read nothing (uniform over all slots either way)."""
    keys = jax.random.split(jax.random.key(3), 7)
    B, KVH, G, Dh = 4, 2, 3, 8
    q = jax.random.normal(keys[0], (B, 1, KVH * G, Dh)) * 2
    sizes = (5, 4, 3)
    ks = tuple(jax.random.normal(keys[1 + i], (B, KVH, n, Dh)) * 3 for i, n in enumerate(sizes))
    vs = tuple(jax.random.normal(keys[4 + i], (B, KVH, n, Dh)) for i, n in enumerate(sizes))
    if int8:
        ks, vs = tuple(map(kv_quant.quantize_kv, ks)), tuple(map(kv_quant.quantize_kv, vs))
    allowed = np.random.default_rng(1).random((B, 12)) < 0.6
    allowed[:, 9:] = False  # the last segment: nobody reads it
    allowed[1] = np.arange(12) < 5  # the prompt segment only
    allowed[2] = False  # nothing
    allowed[0, 0] = True
    one = _attend_one(q, ks, vs, jnp.asarray(allowed))
    merged = _attend_one(q, ks, vs, jnp.asarray(allowed), merged=True)
    np.testing.assert_allclose(merged, one, atol=2e-6, rtol=2e-6)
    assert float(jnp.max(jnp.abs(one[0] - one[3]))) > 0.1  # rows differ: the comparison is not trivial


@pytest.mark.parametrize("scanned", [False, True], ids=["unrolled", "scanned"])
def test_decode_over_an_int8_cache_equals_the_cached_forward_over_it(model, scanned):
    """The sampler's prefill and decode step over an int8 cache (int8 reads, scales folded into the attention) ==
    the model's cached forward fed one token at a time over an int8 cache (dequantized reads), and both differ
    from the float cache's forward."""
    graphdef, params = model
    prompt_len, new_tokens, chunk_len = 5, 4, 3
    S = prompt_len + new_tokens
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, S)), jnp.int32)
    mask = jnp.asarray(np.arange(S)[None, :] >= np.array([[0], [3]]))  # prompt lengths 5 and 2
    mask = mask.at[:, prompt_len:].set(True)
    positions = position_ids_from_mask(mask)
    full, _ = merge_model(graphdef, params)(tokens, positions, mask)

    step = jax.jit(forward, static_argnums=0)
    cache = init_cache(CFG, 2, S, "int8")
    assert kv_quant.is_int8(cache.k) and cache.k.values.shape == (CFG.num_layers, 2, S, CFG.num_kv_heads, 16)
    _, cache = step(graphdef, params, tokens[:, :prompt_len], positions[:, :prompt_len], mask, cache, 0)
    stepped = []
    for t in range(prompt_len, S):
        hidden, cache = step(graphdef, params, tokens[:, t:t + 1], positions[:, t:t + 1], mask, cache, t)
        stepped.append(hidden[:, 0])

    prompt_mask = mask[:, :prompt_len]
    _, prefill = forward(graphdef, params, tokens[:, :prompt_len], positions[:, :prompt_len], prompt_mask,
                         init_cache(CFG, 2, prompt_len, "int8"), 0)
    dcache = decode_cache(prompt_store(prefill), 2, chunk_len, scanned)
    first = dcache.k[0][1]
    assert kv_quant.is_int8(first) and first.values.dtype == jnp.int8 and first.scales.shape[-1] == 1
    for t, hidden, _ in fed_one_token_at_a_time(CFG, params, scanned, dcache, prompt_mask, tokens, positions,
                                                chunk_len):
        np.testing.assert_allclose(hidden, stepped[t - prompt_len], atol=1e-5, rtol=0)
        assert float(jnp.max(jnp.abs(hidden - full[:, t]))) > 1e-4  # the float cache's forward differs
    assert t == S - 1  # every new token was fed
