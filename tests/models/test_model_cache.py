"""Prefill + one-token decode through the KV cache reproduces the full-sequence forward."""

import dataclasses
import functools

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


# The same sizes as a Qwen3-MoE: 8 experts of 32 units, 2 per token.
MOE_CFG = dataclasses.replace(CFG, architecture="qwen3_moe", num_experts=8, experts_per_token=2,
                              moe_intermediate_size=32, norm_topk_prob=True)


@pytest.fixture(scope="module")
def model():
    return split_model(LLM(CFG, rngs=nnx.Rngs(params=1)))


# A periodic stack (decoder_sparse_step 2): layers 0 and 2 dense MLPs, 1 and 3 mixtures of experts.
MOE_STEP2_CFG = dataclasses.replace(MOE_CFG, num_layers=4, decoder_sparse_step=2)


def _moe_model(cfg=MOE_CFG):
    """The MoE sizes with a router 30x wider than its init: top-k margins far above float32 rounding, so the
    decode step and the full forward must route every token alike."""
    graphdef, params = split_model(LLM(cfg, rngs=nnx.Rngs(params=1)))
    params["layers"]["router"] = params["layers"]["router"] * 30
    return graphdef, params


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


def fed_one_token_at_a_time(cfg, params, scanned, cache, prompt_mask, tokens, positions, chunk_len):
    """Feed `tokens` [B, P + n] after the prompt (width P = prompt_mask's) one token per `models.decode` step
    (unrolled, or scanned) over the decode cache `cache`, in chunks of `chunk_len`: yields (t, hidden, routing)."""
    from jgrpo.models.decode import decode_step, decode_step_scanned
    from jgrpo.models.layer_stack import unstack_layers

    if scanned:
        step = functools.partial(jax.jit(decode_step_scanned, static_argnums=(0, 6, 8)), cfg, params)
    else:
        step = functools.partial(jax.jit(decode_step, static_argnums=(0, 7, 9)), cfg, params,
                                 unstack_layers(cfg, params["layers"]))
    B, prompt_len = prompt_mask.shape
    for slot, t in enumerate(range(prompt_len, tokens.shape[1])):
        chunk, offset = divmod(slot, chunk_len)
        # The real prompt slots and the generated slots up to this one, over the chunks read (0 .. chunk).
        allowed = jnp.concatenate([prompt_mask, jnp.broadcast_to(jnp.arange((chunk + 1) * chunk_len) <= slot,
                                                                  (B, (chunk + 1) * chunk_len))], axis=1)
        hidden, cache, routing = step(tokens[:, t], positions[:, t], allowed, cache, chunk, jnp.int32(offset),
                                      chunk + 1)
        yield t, hidden, routing


# A mixture of experts in the CPU's decode (unrolled) and, as a periodic stack, in the TPU's (scanned): each kind of
# MoE stack once per decode form would double the compile time and test nothing the two cases do not.
@pytest.mark.parametrize(("moe", "scanned"), [(None, False), (None, True), (MOE_CFG, False), (MOE_STEP2_CFG, True)],
                         ids=["dense-unrolled", "dense-scanned", "moe-unrolled", "moe_step2-scanned"])
def test_decode_step_matches_full_forward(model, moe, scanned):
    """models.decode (per-layer weights and [B, KVH, S, Dh] caches as the sampler uses them, or its scanned form)
    == the full forward; a mixture of experts also routes each fed token to the experts the full forward picks."""
    from jgrpo.models.decode import decode_cache, prompt_store
    from jgrpo.models.llm import merge_model

    graphdef, params = _moe_model(moe) if moe else model
    cfg = moe or CFG
    prompt_len, new_tokens, repeats = 5, 4, 2
    rng = np.random.default_rng(1)
    prompts = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, prompt_len)), jnp.int32)
    prompt_mask = jnp.asarray(np.arange(prompt_len)[None, :] >= np.array([[0], [3]]))  # lengths 5 and 2
    # Each prompt continues with the same new tokens in both of its rows, so rows of one prompt must agree.
    tokens = jnp.concatenate([jnp.repeat(prompts, repeats, 0),
                              jnp.asarray(rng.integers(0, CFG.vocab_size, (4, new_tokens)), jnp.int32)], 1)
    mask = jnp.concatenate([jnp.repeat(prompt_mask, repeats, 0), jnp.ones((4, new_tokens), bool)], 1)
    positions = position_ids_from_mask(mask)
    full, _, full_routing = merge_model(graphdef, params).routed(tokens, positions, mask)

    _, prefill = forward(graphdef, params, prompts, position_ids_from_mask(prompt_mask), prompt_mask,
                         init_cache(cfg, 2, prompt_len), 0)
    chunk_len = 3  # 4 fed slots in chunks of 3: two segments, the second one ragged
    store = prompt_store(prefill)
    cache = decode_cache(jax.tree.map(lambda x: jnp.repeat(x, repeats, axis=1), store), 2, chunk_len, scanned)
    if scanned:
        assert len(cache.k) == 1 and cache.k[0][1].shape == (cfg.num_layers, 4, CFG.num_kv_heads, chunk_len, 16)
    else:
        assert len(cache.k) == cfg.num_layers and len(cache.k[0]) == 3
        assert cache.k[0][0].shape == (4, CFG.num_kv_heads, prompt_len, CFG.head_dim)
        assert cache.k[0][1].shape == (4, CFG.num_kv_heads, chunk_len, CFG.head_dim)
    row_prompt_mask = jnp.repeat(prompt_mask, repeats, 0)
    for t, hidden, routing in fed_one_token_at_a_time(cfg, params, scanned, cache, row_prompt_mask, tokens, positions,
                                                      chunk_len):
        np.testing.assert_allclose(hidden, full[:, t], atol=1e-5, rtol=0)
        if moe:
            assert routing.shape == (4, cfg.num_layers // cfg.decoder_sparse_step, 2)
            np.testing.assert_array_equal(routing, full_routing[:, t])  # [B, L, k]
        else:
            assert routing is None and full_routing is None
    assert t == tokens.shape[1] - 1  # every new token was fed
