"""The paged KV cache's accounting (jgrpo.sampling.pages, jgrpo.sampling.decode_loop): pages taken and given back
by hand; a group's prompt stored once; every page back after many rows; a budget too small for every row at once
preempts rows, counts it, and still completes every row with the tokens an unbounded pool gives."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.sampling import decode_loop, pages
from jgrpo.sampling.layout import attention_block
from jgrpo.sampling.sampler import Prompts, Sampler, SamplingMethod
from tests.helpers import generate
from tests.helpers_models import sampler_prompts

STOPS = tuple(range(2, 14))  # most rows stop early, some run to the end


def test_take_and_give_by_hand():
    free = pages.initial(6, jnp.array([2, 0]))  # queue 0: pages 0, 1 hold prompts; queue 1: none
    assert free.count.tolist() == [4, 6]
    free, got = pages.take(free, jnp.array([[True, False, True], [True, True, True]]))
    assert got.tolist() == [[2, 6, 3], [0, 1, 2]]  # the lowest free page first; 6 = none
    assert free.count.tolist() == [2, 3]
    free, got = pages.take(free, jnp.array([[True, True, True], [False, False, False]]))
    assert got.tolist() == [[4, 5, 6], [6, 6, 6]]  # queue 0 runs out: the third wanter gets none
    free = pages.give(free, jnp.array([[3, 6, 2], [6, 6, 1]]))
    assert free.count.tolist() == [2, 4]
    free, got = pages.take(free, jnp.array([[True, True], [True, False]]))
    assert got.tolist() == [[2, 3], [1, 6]]  # what was given back is taken first


def test_prompt_tables_by_hand():
    table, used = pages.prompt_tables(jnp.array([[5, 1, 8], [0, 7, 3]]), 4, 2, 99)
    assert table.tolist() == [[[0, 1], [2, 99], [3, 4]], [[99, 99], [0, 1], [2, 99]]]
    assert used.tolist() == [5, 3]


def test_pool_pages_default_and_too_few():
    assert pages.pool_pages(0, prompts=3, prompt_pages=2, slots=4, own_pages=5) == 3 * 2 + 4 * 5
    assert pages.pool_pages(11, prompts=3, prompt_pages=2, slots=4, own_pages=5) == 11
    with pytest.raises(ValueError, match="sampler.kv_pages=10 per queue is too few.*at least 11"):
        pages.pool_pages(10, prompts=3, prompt_pages=2, slots=4, own_pages=5)


def test_the_xla_attention_block_covers_a_table_in_even_blocks():
    # At most BLOCK_TOKENS (256) tokens' entries a block, as few blocks as cover the table, entries spread evenly:
    # pages of 16 -> at most 16 entries; of 64 -> at most 4.
    assert [attention_block(e, 16) for e in (1, 7, 16, 17, 20, 33)] == [1, 7, 16, 9, 10, 11]
    assert [attention_block(e, 64) for e in (2, 4, 5, 9)] == [2, 4, 3, 3]
    assert attention_block(3, 512) == 1  # a page over BLOCK_TOKENS: one entry at a time


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _run(graphdef, params, prompts, key, *, spec):
    """The whole program, returning its final state: (the prompt store, the pool after prefill, the pool after)."""
    w = decode_loop.weights(graphdef, params, spec.plan)
    store, pool = decode_loop.start(spec, w, prompts, key, jnp.int32(0))
    return store, pool, decode_loop.decode(spec, w, store, pool)


def _final(graphdef, params, tokens, mask, **options):
    sampler = Sampler(graphdef, **options)
    prompts, cfg = sampler.checked(params, Prompts(tokens, mask))
    spec = sampler.spec(*tokens.shape, cfg)
    return spec, *_run(graphdef, params, prompts, jax.random.key(2), spec=spec)


def _prompts(batch: int, seed: int = 0):
    """`batch` left-padded prompts of 1 to 13 tokens (width 13)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 14, batch)
    tokens = np.zeros((batch, 13), np.int32)
    mask = np.arange(13)[None, :] >= 13 - lengths[:, None]
    tokens[mask] = rng.integers(3, 90, int(mask.sum()))
    return tokens, mask, lengths


def test_every_page_comes_back_after_100_rows_through_8_slots(tiny_llama):
    graphdef, params = tiny_llama
    tokens, mask, lengths = _prompts(25)
    options = dict(num_samples=4, max_new_tokens=10, method=SamplingMethod(temperature=1.3), stop_ids=STOPS,
                   slots=8, page_size=4)
    spec, store, started, done = _final(graphdef, params, tokens, mask, **options)
    plan = spec.plan
    # The prompts took ceil(length / 4) pages each, once for their G = 4 rows: 1.0 prompt copy per group.
    prompt_pages = int(np.sum(-(-lengths // 4)))
    assert plan.pages == 25 * plan.prompt_pages + 8 * plan.own_pages  # by default every slot's row at its longest
    assert int(started.free.count[0]) == plan.pages - prompt_pages
    assert int(np.sum(np.asarray(store.table) < plan.pages)) == prompt_pages
    # After 100 rows every page is back, no row holds one, no prompt is referenced, nothing was preempted.
    assert int(done.free.count[0]) == plan.pages
    assert sorted(np.asarray(done.free.stack[0]).tolist()) == list(range(plan.pages))
    assert (np.asarray(done.rows.pages) == plan.pages).all() and (np.asarray(done.refs) == 0).all()
    assert not np.asarray(done.rows.queued).any() and (np.asarray(done.rows.preempted) == 0).all()
    lengths_out = np.asarray(done.rows.lengths).reshape(-1)
    assert (lengths_out >= 1).all() and lengths_out.max() == 10 and lengths_out.min() < 4


def test_a_budget_too_small_preempts_counts_and_completes_every_row(tiny_llama):
    """Pages for the prompts and 3 rows at their longest, 8 slots: rows start as pages allow and the youngest are
    preempted where a step finds too few; every row completes with the tokens an unbounded pool gives it."""
    graphdef, params = tiny_llama
    tokens, mask = sampler_prompts()
    options = dict(num_samples=4, max_new_tokens=12, method=SamplingMethod(temperature=1.0), stop_ids=(2, 3, 4),
                   key=jax.random.key(6), page_size=2)
    unbounded = generate(graphdef, params, tokens, mask, slots=8, **options)
    sampler = Sampler(graphdef, slots=8, **{k: v for k, v in options.items() if k != "key"})
    plan = sampler.spec(*tokens.shape, _cfg(graphdef, params)).plan
    budget = 4 * plan.prompt_pages + 3 * plan.own_pages
    bounded = generate(graphdef, params, tokens, mask, slots=8, kv_pages=budget, **options)
    preempted = np.asarray(bounded.preempted)
    assert preempted.sum() > 0, "the budget should have preempted some row"
    np.testing.assert_array_equal(bounded.tokens, unbounded.tokens)
    np.testing.assert_array_equal(bounded.lengths, unbounded.lengths)
    np.testing.assert_allclose(bounded.logprobs, unbounded.logprobs, atol=1e-5, rtol=0)
    assert (np.asarray(unbounded.preempted) == 0).all()


def _cfg(graphdef, params):
    from jgrpo.models.llm import model_config

    return model_config(graphdef, params)
