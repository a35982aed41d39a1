"""Prefill + one-token decode through the KV cache reproduces the full-sequence forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jgrpo.models.llm import LLM, LLMConfig, forward, init_cache, position_ids_from_mask, split_model

CFG = LLMConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=100000.0,
    qkv_bias=True,
    qk_norm=True,
)


@pytest.fixture(scope="module")
def model():
    return split_model(LLM(CFG, rngs=nnx.Rngs(params=1)))


def test_prefill_then_decode_matches_full_forward(model):
    graphdef, params = model
    prompt_len, new_tokens = 6, 5
    S = prompt_len + new_tokens
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, S)), jnp.int32)
    # Left-padded prompts of lengths 6, 2 and 4; every generated slot is real.
    prompt_mask = np.arange(prompt_len)[None, :] >= np.array([[0], [4], [2]])
    mask = jnp.asarray(np.concatenate([prompt_mask, np.ones((3, new_tokens), bool)], axis=1))
    positions = position_ids_from_mask(mask)
    full, _ = jax.jit(forward, static_argnums=0)(graphdef, params, tokens, positions, mask)

    step = jax.jit(forward, static_argnums=0, donate_argnames="cache")
    cache = init_cache(CFG, 3, S)
    hidden, cache = step(graphdef, params, tokens[:, :prompt_len], positions[:, :prompt_len], mask, cache, 0)
    outputs = [hidden]
    for t in range(prompt_len, S):
        hidden, cache = step(graphdef, params, tokens[:, t : t + 1], positions[:, t : t + 1], mask, cache, t)
        outputs.append(hidden)
    incremental = jnp.concatenate(outputs, axis=1)
    np.testing.assert_allclose(incremental[mask], full[mask], atol=1e-5, rtol=0)
    assert cache.k.shape == (CFG.num_layers, 3, S, CFG.num_kv_heads, CFG.head_dim)


def test_unwritten_cache_slots_are_ignored(model):
    """Slots past cache_index hold garbage from earlier use; causality over slots must hide them."""
    graphdef, params = model
    tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    mask = jnp.ones((1, 8), bool)
    positions = position_ids_from_mask(mask[:, :4])
    clean, _ = forward(graphdef, params, tokens, positions, mask, init_cache(CFG, 1, 8), 0)
    garbage = jax.tree.map(lambda x: x + 7.0, init_cache(CFG, 1, 8))
    dirty, _ = forward(graphdef, params, tokens, positions, mask, garbage, 0)
    np.testing.assert_allclose(dirty, clean, atol=1e-6)


def test_cache_requires_index_and_matching_mask(model):
    graphdef, params = model
    tokens = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="cache_index"):
        forward(graphdef, params, tokens, tokens, jnp.ones((2, 4), bool), init_cache(CFG, 2, 4))
    with pytest.raises(ValueError, match="kv_mask"):
        forward(graphdef, params, tokens, tokens, jnp.ones((2, 3), bool), init_cache(CFG, 2, 4), 0)
