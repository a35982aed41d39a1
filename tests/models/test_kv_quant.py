"""The int8 KV cache (`sampler.kv_cache_dtype: int8`, models/kv_quant.py): the round trip, the paged attention's
int8 read against attention over the dequantized pages, and the decode step over int8 pages (unrolled and scanned)
against the cached forward over the same int8 cache, token by token."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jgrpo.models import kv_quant
from jgrpo.models.llm import LLM, forward, init_cache, merge_model, position_ids_from_mask, split_model
from jgrpo.models.paged_attention import paged_attention_xla
from tests.models.test_model_cache import (
    CFG,  # 3 layers, 4 heads over 2 KV heads of 16, biases and qk-norm
    PagedRows,
    fed_one_token_at_a_time,
)
from tests.models.test_paged_attention import random_pages


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


def test_int8_attention_equals_attention_over_the_dequantized_pages():
    q, k_pool, v_pool, view = random_pages(jax.random.key(1))
    ks, vs = kv_quant.quantize_kv(k_pool), kv_quant.quantize_kv(v_pool)
    int8 = paged_attention_xla(q, ks, vs, view, block=2)
    dequantized = paged_attention_xla(q, kv_quant.dequantize_kv(ks), kv_quant.dequantize_kv(vs), view, block=2)
    np.testing.assert_allclose(int8, dequantized, atol=1e-5, rtol=0)
    exact = paged_attention_xla(q, k_pool, v_pool, view, block=2)
    assert 1e-4 < float(jnp.max(jnp.abs(int8 - exact))) < 0.1  # quantized, and close


@pytest.mark.parametrize("scanned", [False, True], ids=["unrolled", "scanned"])
def test_decode_over_an_int8_cache_equals_the_cached_forward_over_it(model, scanned):
    """The sampler's prefill and decode step over an int8 cache (int8 reads, scales folded into the attention) ==
    the model's cached forward fed one token at a time over an int8 cache (dequantized reads), and both differ
    from the float cache's forward."""
    graphdef, params = model
    prompt_len, new_tokens = 5, 4
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
    paged = PagedRows(CFG, prefill, prompt_mask, 1, new_tokens, page_size=2, stacked=scanned)
    pool = paged.cache.k[0]
    assert kv_quant.is_int8(pool) and pool.values.dtype == jnp.int8 and pool.scales.shape[-1] == 1
    for t, hidden, _ in fed_one_token_at_a_time(CFG, params, scanned, paged, tokens, positions, prompt_len):
        np.testing.assert_allclose(hidden, stepped[t - prompt_len], atol=1e-5, rtol=0)
        assert float(jnp.max(jnp.abs(hidden - full[:, t]))) > 1e-4  # the float cache's forward differs
    assert t == S - 1  # every new token was fed
