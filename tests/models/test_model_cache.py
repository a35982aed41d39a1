"""Prefill + one-token decode through the KV cache reproduces the full-sequence forward."""

import dataclasses

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


class PagedRows:
    """Rows laid out in pages by hand, as the sampler lays them out: each prompt's real tokens from page 0 of its
    own pages (the last part full), shared by its `repeats` rows, then each row's own pages; Q = 1 queue."""

    def __init__(self, cfg, prefill, prompt_mask, repeats: int, new_tokens: int, page_size: int, stacked: bool):
        from jgrpo.models import kv_quant, paged_kv

        prompts, P = prompt_mask.shape
        self.page_size, self.repeats = page_size, repeats
        self.lengths = np.asarray(prompt_mask).sum(1)
        count = -(-self.lengths // page_size)
        self.prompt_pages = -(-P // page_size)
        self.own_pages = -(-new_tokens // page_size)
        rows = prompts * repeats
        self.pages = int(count.sum()) + rows * self.own_pages
        start = np.cumsum(count) - count
        self.prompt_table = np.full((prompts, self.prompt_pages), self.pages)
        for b in range(prompts):
            self.prompt_table[b, :count[b]] = start[b] + np.arange(count[b])
        self.own_table = count.sum() + np.arange(rows * self.own_pages).reshape(rows, self.own_pages)
        # Prompt b's token i: column P - length_b + i of the left-padded prefill cache.
        columns = np.clip(P - self.lengths[:, None] + np.arange(self.prompt_pages * page_size), 0, P - 1)

        def paged(x):  # [L, B, P, KVH, Dh] -> [L, 1, B, pp, KVH, ps, Dh]
            x = jnp.take_along_axis(x, jnp.asarray(columns)[None, :, :, None, None], axis=2)
            x = x.reshape(x.shape[0], prompts, self.prompt_pages, page_size, *x.shape[3:])
            return jnp.swapaxes(x, 3, 4)[:, None]

        new = kv_quant.per_part(lambda c: jax.tree.map(paged, c), prefill)
        dtype = "int8" if kv_quant.is_int8(prefill.k) else jnp.dtype(prefill.k.dtype).name
        cache = paged_kv.empty(cfg, 1, self.pages, page_size, dtype, stacked)
        table = jnp.asarray(self.prompt_table)[None]
        if stacked:
            write = jax.vmap(lambda pool, x: paged_kv.write_pages(pool, x, table))
            self.cache = paged_kv.PagedKV((write(cache.k[0], new.k),), (write(cache.v[0], new.v),))
        else:
            layer = lambda c, i: kv_quant.per_part(lambda x: x[i], c)  # noqa: E731
            self.cache = paged_kv.PagedKV(*(tuple(paged_kv.write_pages(pool, layer(parts, i), table)
                                                  for i, pool in enumerate(pools))
                                            for pools, parts in ((cache.k, new.k), (cache.v, new.v))))

    def inputs(self, tokens, positions, own: int):
        """StepInputs of every row feeding its own token `own` (0, 1, ...)."""
        from jgrpo.models.decode_step import StepInputs
        from jgrpo.models.paged_kv import PageView

        rows = len(tokens)
        prompt = np.arange(rows) // self.repeats
        count = -(-self.lengths[prompt] // self.page_size)
        table = np.full((rows, self.prompt_pages + self.own_pages), self.pages)
        for r in range(rows):
            table[r, :count[r]] = self.prompt_table[prompt[r], :count[r]]
            table[r, count[r]:count[r] + self.own_pages] = self.own_table[r]
        view = PageView(jnp.asarray(table)[None], jnp.asarray(count)[None], jnp.asarray(self.lengths[prompt])[None],
                        jnp.full((1, rows), own + 1))
        page = jnp.asarray(self.own_table[:, own // self.page_size])[None]
        return StepInputs(tokens, positions, view, page, jnp.full((1, rows), own % self.page_size))


def fed_one_token_at_a_time(cfg, params, scanned, paged: PagedRows, tokens, positions, prompt_len):
    """Feed `tokens` [B, P + n] after the prompt (width P) one token per `models.decode_step` step (unrolled, or
    scanned) over the pages `paged` lays out: yields (t, hidden, routing)."""
    from jgrpo.models.decode_step import StepOptions, decode_step
    from jgrpo.models.layer_stack import unstack_layers

    layers = None if scanned else unstack_layers(cfg, params["layers"])
    step = jax.jit(decode_step, static_argnums=(0, 5))
    options = StepOptions(scanned=scanned, attention="xla", block=2)  # several blocks of table entries
    cache = paged.cache
    for own, t in enumerate(range(prompt_len, tokens.shape[1])):
        hidden, cache, routing = step(cfg, params, layers, cache, paged.inputs(tokens[:, t], positions[:, t], own),
                                      options)
        yield t, hidden, routing


# A mixture of experts in the CPU's decode (unrolled) and, as a periodic stack, in the TPU's (scanned): each kind of
# MoE stack once per decode form would double the compile time and test nothing the two cases do not.
@pytest.mark.parametrize(("moe", "scanned"), [(None, False), (None, True), (MOE_CFG, False), (MOE_STEP2_CFG, True)],
                         ids=["dense-unrolled", "dense-scanned", "moe-unrolled", "moe_step2-scanned"])
def test_decode_step_matches_full_forward(model, moe, scanned):
    """models.decode_step over pages (two rows sharing each prompt's pages, pages of 2 tokens: a prompt of 5 on
    three, the last part full; per-layer pools, or the scanned form's stacked ones) == the full forward; a mixture
    of experts also routes each fed token to the experts the full forward picks."""
    from jgrpo.models.llm import merge_model

    graphdef, params = _moe_model(moe) if moe else model
    cfg = moe or CFG
    prompt_len, new_tokens, repeats = 5, 4, 2
    rng = np.random.default_rng(1)
    prompts = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, prompt_len)), jnp.int32)
    prompt_mask = jnp.asarray(np.arange(prompt_len)[None, :] >= np.array([[0], [3]]))  # lengths 5 and 2
    # Each prompt continues with other new tokens in each of its rows: rows of one prompt share its pages only.
    tokens = jnp.concatenate([jnp.repeat(prompts, repeats, 0),
                              jnp.asarray(rng.integers(0, CFG.vocab_size, (4, new_tokens)), jnp.int32)], 1)
    mask = jnp.concatenate([jnp.repeat(prompt_mask, repeats, 0), jnp.ones((4, new_tokens), bool)], 1)
    positions = position_ids_from_mask(mask)
    full, _, full_routing = merge_model(graphdef, params).routed(tokens, positions, mask)

    _, prefill = forward(graphdef, params, prompts, position_ids_from_mask(prompt_mask), prompt_mask,
                         init_cache(cfg, 2, prompt_len), 0)
    paged = PagedRows(cfg, prefill, prompt_mask, repeats, new_tokens, page_size=2, stacked=scanned)
    assert paged.pages == 4 + 4 * 2  # the prompts' pages once (3 + 1), then 2 of each row's own
    pool = paged.cache.k[0]
    assert pool.shape == ((cfg.num_layers,) if scanned else ()) + (1, 12, CFG.num_kv_heads, 2, CFG.head_dim)
    for t, hidden, routing in fed_one_token_at_a_time(cfg, params, scanned, paged, tokens, positions, prompt_len):
        np.testing.assert_allclose(hidden, full[:, t], atol=1e-5, rtol=0)
        if moe:
            assert routing.shape == (4, cfg.num_layers // cfg.decoder_sparse_step, 2)
            np.testing.assert_array_equal(routing, full_routing[:, t])  # [B, L, k]
        else:
            assert routing is None and full_routing is None
    assert t == tokens.shape[1] - 1  # every new token was fed
