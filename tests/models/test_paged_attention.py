"""Attention over pages (models/paged_attention.py) against the softmax formula over each row's tokens gathered by
hand, on ragged rows: an empty row, a row on one page, rows ending at and just past page boundaries, rows sharing
their prompt's pages (its last page part full), entries past a row's live ones pointing at pages other rows use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.models import kv_quant
from jgrpo.models.paged_attention import paged_attention, paged_attention_xla, resolve_paged_attention
from jgrpo.models.paged_kv import PageView

PS, PAGES, KVH, G, DH = 4, 16, 2, 3, 8
# Per row: (its prompt's pages, the prompt's tokens, its own pages, its own tokens). Rows 1 and 2 share prompt pages
# [0, 1] (6 tokens: the second page part full); row 0 is empty; row 3 sits on one page; row 4 ends at a page
# boundary (8 own tokens), row 5 one token past one.
ROWS = [([], 0, [], 0), ([0, 1], 6, [2, 3], 5), ([0, 1], 6, [4], 1), ([5], 3, [], 0), ([6], 4, [7, 8], 8),
        ([9, 10, 11], 12, [12, 13, 14], 9)]
ENTRIES = 6


def random_pages(key, rows=ROWS, page_size=PS, pages=PAGES, entries=ENTRIES):
    """(q [1, n, H, Dh], k_pool, v_pool [1, pages, KVH, page_size, Dh], view) of `rows`; table entries past a row's
    live ones hold the last page, which no row's tokens are on (what a stale table would): never to be read."""
    keys = jax.random.split(key, 3)
    q = jax.random.normal(keys[0], (1, len(rows), KVH * G, DH))
    k_pool = jax.random.normal(keys[1], (1, pages, KVH, page_size, DH)) * 3
    v_pool = jax.random.normal(keys[2], (1, pages, KVH, page_size, DH))
    table = np.full((len(rows), entries), pages - 1)
    for r, (prompt, _, own, _) in enumerate(rows):
        table[r, :len(prompt) + len(own)] = prompt + own
    view = PageView(jnp.asarray(table)[None], jnp.asarray([[len(p) for p, *_ in rows]]),
                    jnp.asarray([[n for _, n, *_ in rows]]), jnp.asarray([[n for *_, n in rows]]))
    return q, k_pool, v_pool, view


def reference(q, k_pool, v_pool, rows=ROWS):
    """softmax(q k^T / sqrt(Dh)) v over each row's tokens, gathered by hand from its pages."""
    PS = k_pool.shape[3]  # noqa: N806 - the page size, as the module's constant names it
    out = []
    for r, (prompt, prompt_len, own, own_len) in enumerate(rows):
        tokens = [(p, i) for p in prompt for i in range(PS)][:prompt_len] + [(p, i) for p in own
                                                                             for i in range(PS)][:own_len]
        if not tokens:
            out.append(np.zeros((KVH * G, DH)))
            continue
        k = np.stack([np.asarray(k_pool[0, p, :, i]) for p, i in tokens], 1)  # [KVH, T, Dh]
        v = np.stack([np.asarray(v_pool[0, p, :, i]) for p, i in tokens], 1)
        qr = np.asarray(q[0, r]).reshape(KVH, G, DH)
        scores = np.einsum("kgd,ktd->kgt", qr, k) / np.sqrt(DH)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out.append(np.einsum("kgt,ktd->kgd", probs, v).reshape(KVH * G, DH))
    return np.stack(out)[None]


@pytest.mark.parametrize("block", [1, 2, 4])
def test_xla_blocks_equal_the_formula_on_ragged_rows(block):
    q, k_pool, v_pool, view = random_pages(jax.random.key(0))
    out = jax.jit(paged_attention_xla, static_argnums=4)(q, k_pool, v_pool, view, block)
    np.testing.assert_allclose(out, reference(q, k_pool, v_pool), atol=2e-6, rtol=2e-6)
    assert float(jnp.abs(out[0, 1] - out[0, 2]).max()) > 0.1  # rows sharing a prompt differ by their own tokens


def test_int8_pages_fold_their_scales_in():
    q, k_pool, v_pool, view = random_pages(jax.random.key(1))
    ks, vs = kv_quant.quantize_kv(k_pool), kv_quant.quantize_kv(v_pool)
    out = paged_attention("xla", q, ks, vs, view, 2)
    np.testing.assert_allclose(out, reference(q, kv_quant.dequantize_kv(ks), kv_quant.dequantize_kv(vs)),
                               atol=1e-5, rtol=1e-5)


def test_the_choice_by_platform():
    assert [resolve_paged_attention("auto", p) for p in ("cpu", "gpu", "tpu")] == ["xla", "xla", "pallas"]
    with pytest.raises(ValueError, match="paged_attention must be auto or one of"):
        resolve_paged_attention("flash", "cpu")


def test_the_tpu_kernel_equals_the_formula_in_the_interpreter():
    """The `pallas` kernel (models/paged_attention_tpu.py) in Pallas's TPU interpreter on CPU, on the ragged rows:
    the formula's output, float pages of one layer, and int8 pages stacked as the scanned decode holds them (read
    at their layer, in place). It is compiled for v5e inside the sampler program by tests/planning/test_hlo_cost.py."""
    from jgrpo.models.paged_attention_tpu import paged_attention_tpu

    q, k_pool, v_pool, view = random_pages(jax.random.key(2))
    np.testing.assert_allclose(paged_attention_tpu(q, k_pool, v_pool, view), reference(q, k_pool, v_pool),
                               atol=2e-6, rtol=2e-6)
    ks, vs = kv_quant.quantize_kv(k_pool), kv_quant.quantize_kv(v_pool)
    want = reference(q, kv_quant.dequantize_kv(ks), kv_quant.dequantize_kv(vs))
    stacked = [kv_quant.per_part(lambda x: jnp.stack([x[:, ::-1], x]), p) for p in (ks, vs)]  # layer 0: other pages
    np.testing.assert_allclose(paged_attention_tpu(q, *stacked, view, layer=jnp.int32(1)), want, atol=2e-6, rtol=2e-6)


def laid_out(page_size: int, rows: list[tuple[str | None, int, int]]):
    """ROWS-style rows for `page_size` from (prompt name or None, prompt tokens, own tokens): each named prompt's
    pages laid out once and shared by the rows that name it, each row's own pages after them."""
    prompts, out, next_page = {}, [], 0

    def pages(tokens):
        nonlocal next_page
        count = -(-tokens // page_size)
        next_page += count
        return list(range(next_page - count, next_page))

    for name, prompt_tokens, own_tokens in rows:
        if name is not None and name not in prompts:
            prompts[name] = pages(prompt_tokens)
        out.append((prompts.get(name, []), prompt_tokens, pages(own_tokens), own_tokens))
    return out, next_page + 1  # one page more: the stale entries' page


@pytest.mark.parametrize(("dtype", "page_size"), [("float32", 32), ("float32", 64), ("int8", 64)])
def test_the_tpu_kernel_reads_part_full_pages_to_the_granule(dtype, page_size):
    """Pages larger than the kernel's read granule (a tile's rows: 8 float32 tokens, 32 int8): a part-full page is
    copied up to its last live token rounded to the granule, the rest of its buffer left stale (NaN in Pallas's
    interpreter), and the output is still the formula's: one granule, one token past one, one short of a page,
    a whole page, prompts shared and not."""
    from jgrpo.models.paged_attention_tpu import paged_attention_tpu, read_granule

    g = read_granule(dtype, page_size)
    assert (g, page_size // g) == {("float32", 32): (8, 4), ("float32", 64): (8, 8), ("int8", 64): (32, 2)}[
        (dtype, page_size)]
    rows, pages = laid_out(page_size, [("a", page_size + g, 1), ("a", page_size + g, page_size + g + 1),
                                       ("b", 1, page_size), ("b", 1, 2 * page_size - 1), (None, 0, 0),
                                       ("c", g - 1, g)])
    q, k_pool, v_pool, view = random_pages(jax.random.key(3), rows, page_size, pages, entries=4)
    if dtype == "int8":
        k_pool, v_pool = kv_quant.quantize_kv(k_pool), kv_quant.quantize_kv(v_pool)
        want = reference(q, kv_quant.dequantize_kv(k_pool), kv_quant.dequantize_kv(v_pool), rows)
    else:
        want = reference(q, k_pool, v_pool, rows)
    out = paged_attention_tpu(q, k_pool, v_pool, view)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, want, atol=3e-6, rtol=3e-6)
