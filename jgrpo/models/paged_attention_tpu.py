"""The `pallas` paged attention (`sampler.paged_attention`): a Pallas TPU kernel that reads each row's live pages and
nothing else.

One kernel instance per (row, KV head). It reads the row's page table and lengths from SMEM (scalar prefetch),
then walks its live table entries in blocks of `_BLOCK` pages: the live tokens of each page's [page_size, Dh] slice
of this KV head are copied from HBM into VMEM in one copy (two buffers: the next block's copies run while this
block computes), scored against the head's G query heads, and folded into a running softmax (log-sum-exp, as
flash-decoding does), page by page, with the page's token count from the view (`PageView.tokens_in`: a prompt's
last page part full, a row's last own page part full). A part-full page is copied up to its last live token rounded
up to the TPU's tile of rows (`read_granule`: 16 tokens in bfloat16), not whole: a row's two part-full pages
(its prompt's last, its own last) would otherwise read half a page each of nothing, 1.36x the live bytes of
GSM8K-length rows in 64-token pages instead of 1.06x (benchmarks/paged_kv.py). An entry past the row's live ones
is neither copied nor scored, so a step reads its rows' live tokens to the granule: what `jgrpo.plan` counts from
the page tables for this custom call (the HLO cost sees nothing inside a kernel). Int8 pages are copied as int8
with their per-token scales and scaled in VMEM.

Rows are over the mesh's batch axes and KV heads over tensor (`shard_map` over the context mesh, as splash is):
the pools, the queries and the views of a device are its own queues'. Why our own kernel and not jax's
`ragged_paged_attention` (docs/configuration.md): that one takes a row's tokens as one contiguous run of pages,
so a group's prompt would be stored once per row from its last, part-full page on (1.6 copies of a 200-token
prompt in 16-token pages); it takes int8 pages with one static scale per call (ours have one per token and
head); it refuses head counts it cannot tile (SmolLM2: 6 combined heads); and it does not run in interpret mode.
jax's decode `paged_attention` has the same contiguity. Learned from both; written for this cache's layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from jgrpo.models import kv_quant
from jgrpo.models.paged_kv import PageView
from jgrpo.parallel.mesh import BATCH_AXES, context_platform, dividing_axes

_BLOCK = 4  # pages copied per block (double-buffered)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a masked score never makes inf - inf


def read_granule(dtype, page_size: int) -> int:
    """Tokens a part-full page is read in multiples of: the rows of one TPU tile of `dtype` (8 float32, 16
    bfloat16, 32 int8: a copy that starts and ends on tile rows), or the whole page where that does not divide it."""
    rows = 32 // jnp.dtype(dtype).itemsize
    return rows if rows < page_size and page_size % rows == 0 else page_size


def _kernel(layer_ref, table_ref, prompt_pages_ref, prompt_len_ref, own_len_ref, q_ref, k_hbm, v_hbm, *rest,
            entries: int, page_size: int, granule: int, int8: bool):
    """Row b, KV head h: o [G, Dh] = softmax(q k^T / sqrt(Dh)) v over the row's live pages of layer `layer` (the
    pools are the stacked [L, pages, KVH, ps, Dh]: a page is copied from where it lies, no layer is sliced out)."""
    if int8:
        k_scale_hbm, v_scale_hbm, o_ref, k_buf, v_buf, k_scale_buf, v_scale_buf, m_ref, l_ref, acc_ref, sems = rest
    else:
        o_ref, k_buf, v_buf, m_ref, l_ref, acc_ref, sems = rest
    b, h, layer = pl.program_id(0), pl.program_id(1), layer_ref[0]
    prompt_pages, prompt_len, own_len = prompt_pages_ref[b], prompt_len_ref[b], own_len_ref[b]
    live = prompt_pages + (own_len + page_size - 1) // page_size
    blocks = (live + _BLOCK - 1) // _BLOCK

    def tokens(entry):
        """The live tokens of table entry `entry` of row b (0 past its live entries)."""
        own = entry - prompt_pages
        return jnp.clip(jnp.where(own < 0, prompt_len - entry * page_size, own_len - own * page_size), 0, page_size)

    def copies(block, slot):
        """(condition, copies) of each page of `block` into buffer `slot`: keys, values (and their scales), of the
        page's first n granules for each n (one copy size per n: a copy's shape is static), so that exactly one
        condition of a live page holds, the one that covers its live tokens."""
        out = []
        for j in range(_BLOCK):
            entry = block * _BLOCK + j
            page = table_ref[b * entries + jnp.minimum(entry, entries - 1)]
            need = (tokens(entry) + granule - 1) // granule
            pairs = [(k_hbm, k_buf), (v_hbm, v_buf)] + ([(k_scale_hbm, k_scale_buf), (v_scale_hbm, v_scale_buf)]
                                                        if int8 else [])
            for n in range(1, page_size // granule + 1):
                rows = pl.ds(0, n * granule)
                out.append(((entry < live) & (need == n),
                            [pltpu.make_async_copy(src.at[layer, page, h, rows], dst.at[slot, j, rows], sems.at[slot])
                             for src, dst in pairs]))
        return out

    def start(block, slot):
        for condition, each in copies(block, slot):
            @pl.when(condition)
            def _(each=each):  # (run at once by pl.when; the default binds this page's copies)
                for c in each:
                    c.start()

    @pl.when(blocks > 0)
    def _():
        start(0, 0)

    m_ref[...] = jnp.full(m_ref.shape, _MASK, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    q = q_ref[...].astype(jnp.float32) * (q_ref.shape[-1] ** -0.5)  # [G, Dh]

    def body(block, _):
        slot = block % 2

        @pl.when(block + 1 < blocks)
        def _():
            start(block + 1, 1 - slot)

        for condition, each in copies(block, slot):  # every copy of the block first: one semaphore, any order
            @pl.when(condition)
            def _(each=each):
                for c in each:
                    c.wait()

        for j in range(_BLOCK):
            entry = block * _BLOCK + j

            @pl.when(entry < live)
            def _(j=j, entry=entry):
                k = k_buf[slot, j].astype(jnp.float32)  # [ps, Dh]: rows past the copied granules are stale
                v = v_buf[slot, j].astype(jnp.float32)
                if int8:
                    k = k * k_scale_buf[slot, j]
                    v = v * v_scale_buf[slot, j]
                live_tokens = tokens(entry)
                valid = jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1) < live_tokens  # [1, ps]
                # Stale rows may hold anything (a NaN times a zero probability is a NaN): values past the live
                # tokens are zeroed, scores past them masked.
                v = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0) < live_tokens, v, 0.0)
                scores = jnp.where(valid, jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                                              preferred_element_type=jnp.float32), _MASK)
                m_prev = m_ref[...]  # [G, 1]
                m_next = jnp.maximum(m_prev, scores.max(axis=-1, keepdims=True))
                probs = jnp.where(valid, jnp.exp(scores - m_next), 0.0)  # [G, ps]
                rescale = jnp.exp(m_prev - m_next)
                l_ref[...] = l_ref[...] * rescale + probs.sum(axis=-1, keepdims=True)
                acc_ref[...] = acc_ref[...] * rescale + jnp.dot(probs, v, preferred_element_type=jnp.float32)
                m_ref[...] = m_next
        return ()

    jax.lax.fori_loop(0, blocks, body, ())
    o_ref[...] = (acc_ref[...] / jnp.maximum(l_ref[...], jnp.finfo(jnp.float32).tiny)).astype(o_ref.dtype)


def _one_device(q, k_pool, v_pool, view: PageView, layer, interpret):
    """This device's queues: q [q, n, H, Dh], stacked pools [L, q, NP, KVH, ps, Dh] -> [q, n, H, Dh]."""
    Qd, n, H, Dh = q.shape
    int8 = kv_quant.is_int8(k_pool)
    values = k_pool.values if int8 else k_pool
    L, _, NP, KVH, ps, _ = values.shape
    G, entries, rows = H // KVH, view.table.shape[-1], Qd * n
    # Each row's pages as indices into its device's pools laid end to end: queue i's page p is i * NP + p.
    offset = (jnp.arange(Qd, dtype=jnp.int32) * NP)[:, None, None]
    table = jnp.where(view.table < NP, view.table + offset, 0).reshape(-1)
    flat = lambda x: x.reshape(L, Qd * NP, *x.shape[3:])  # noqa: E731 - a view: the queue and page axes merged
    pools = [flat(k_pool.values), flat(v_pool.values), flat(k_pool.scales), flat(v_pool.scales)] if int8 else \
        [flat(k_pool), flat(v_pool)]
    q_spec = pl.BlockSpec((None, None, G, Dh), lambda b, h, *_: (b, h, 0, 0))
    buffers = [pltpu.VMEM((2, _BLOCK, ps, Dh), values.dtype)] * 2
    if int8:
        buffers += [pltpu.VMEM((2, _BLOCK, ps, 1), jnp.float32)] * 2
    kernel = functools.partial(_kernel, entries=entries, page_size=ps, granule=read_granule(values.dtype, ps),
                               int8=int8)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(rows, KVH),
            in_specs=[q_spec] + [pl.BlockSpec(memory_space=pl.ANY)] * len(pools), out_specs=q_spec,
            scratch_shapes=buffers + [pltpu.VMEM((G, 1), jnp.float32), pltpu.VMEM((G, 1), jnp.float32),
                                      pltpu.VMEM((G, Dh), jnp.float32), pltpu.SemaphoreType.DMA((2,))]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct((rows, KVH, G, Dh), q.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), table,
      *(x.reshape(-1).astype(jnp.int32) for x in (view.prompt_pages, view.prompt_len, view.own_len)),
      q.reshape(rows, KVH, G, Dh), *pools)
    return out.reshape(Qd, n, H, Dh)


def paged_attention_tpu(q, k_pool, v_pool, view: PageView, layer=None):
    """q [Q, n, H, Dh] over the rows' live pages of the pools [Q, NP, KVH, ps, Dh] (with `layer`: of that layer
    of stacked pools [L, Q, NP, ...]) -> [Q, n, H, Dh]; on a CPU in Pallas's TPU interpreter (tests only: slow)."""
    if layer is None:  # one layer's pools: a stack of one
        k_pool, v_pool = (kv_quant.per_part(lambda x: x[None], p) for p in (k_pool, v_pool))
        layer = 0
    layer = jnp.asarray(layer, jnp.int32)
    interpret = context_platform() != "tpu"
    mesh = jax.sharding.get_abstract_mesh()
    run = functools.partial(_one_device, interpret=interpret)
    if mesh.empty:
        return run(q, k_pool, v_pool, view, layer)
    KVH = (k_pool.values if kv_quant.is_int8(k_pool) else k_pool).shape[3]
    rows = dividing_axes(mesh, BATCH_AXES, q.shape[0])
    heads = dividing_axes(mesh, ("tensor",), KVH)
    qs, pool = PartitionSpec(rows, None, heads), PartitionSpec(None, rows, None, heads)
    view_spec = PageView(PartitionSpec(rows), PartitionSpec(rows), PartitionSpec(rows), PartitionSpec(rows))
    pool_spec = kv_quant.Int8KV(pool, pool) if kv_quant.is_int8(k_pool) else pool
    return jax.shard_map(run, mesh=mesh, in_specs=(qs, pool_spec, pool_spec, view_spec, PartitionSpec()),
                         out_specs=qs, check_vma=False)(q, k_pool, v_pool, view, layer)
