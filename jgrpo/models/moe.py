"""The mixture-of-experts MLP of Qwen3-MoE: a float32 softmax router, top-k experts per token, SwiGLU experts.

Router: logits = h @ router [M, E] in the compute dtype; probabilities = softmax over all E in float32; each
token takes its top-k experts, their probabilities renormalised over the k only when `norm_topk_prob` (as
transformers' `Qwen3MoeTopKRouter`), cast back to the compute dtype as gates. The layer's output is the
gate-weighted sum of the k experts' SwiGLU outputs. Dropless: every (token, expert) assignment is computed,
whatever the load, so no token's output depends on how the others were routed.

How the experts' matmuls run, `model.moe_impl` (the same values and gradients, tested against each other):

- `sorted_tiles`: the m*k assignments sorted by expert, each expert's group padded to a multiple of a tile, in a
  static buffer of m*k + E*(tile - 1) rows (rounded to tiles); every tile holds one expert's rows, so one batched
  matmul over tiles (each tile with its expert's weights) does the work: nothing dropped, the shapes fixed (no
  recompiling as the routing changes), ~k/E of the dense flops plus the padding.
- `ragged`: `jax.lax.ragged_dot` over the sorted assignments. Exact; XLA:CPU lowers it densely (an [E, m*k, ...]
  product: ~E times the routed flops), and on an H100 it was 7.3x slower than sorted_tiles.
- `dense`: every expert on every token, the gates zero outside the top k. The reference the others are tested
  against; E/k times the routed flops.

- `megablox`: the Pallas TPU grouped matmul over the sorted assignments, each row tile reading only its groups'
  weights (interpret mode elsewhere, for tests).

`auto` resolves by platform (`resolve_moe_impl`): CPU and GPU sorted_tiles, TPU megablox (sorted_tiles' per-tile
weight copies made Qwen3-30B-A3B's TPU decode step read ~100 GB per chip). benchmarks/moe.py measures the CPU
choices side by side.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models.expert_parallel import ExpertWeights, run_experts
from jgrpo.parallel.mesh import context_platform
from jgrpo.parallel.platform_defaults import resolve

# What `model.moe_impl: auto` picks by platform: megablox on TPU, sorted_tiles elsewhere (XLA:CPU runs ragged_dot
# densely; on an H100 it was 7.3x slower than sorted_tiles: benchmarks/moe.py, accelerator.py; docs/configuration.md).
MOE_AUTO = {"cpu": "sorted_tiles", "tpu": "megablox", "gpu": "sorted_tiles", "other": "sorted_tiles"}


def resolve_moe_impl(choice: str, platform: str) -> str:
    """`model.moe_impl` ("auto" or one of IMPLEMENTATIONS) on devices of `platform`."""
    return resolve("model.moe_impl", choice, tuple(IMPLEMENTATIONS), MOE_AUTO, platform)


def route(h: jax.Array, router: jax.Array, k: int, norm_topk_prob: bool, ids: jax.Array | None = None):
    """(expert ids [M, k] int32, gates [M, k] in h's dtype, router logits [M, E] float32) of tokens h [M, D].

    With `ids` (routing replay: the experts another forward chose) the tokens go to those experts whatever the
    router says now; the gates are still this router's float32 softmax over all E, taken at those ids (and
    renormalised over them when `norm_topk_prob`), so the router keeps its gradient."""
    logits = jnp.matmul(h, router.astype(h.dtype)).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if ids is None:
        top, ids = jax.lax.top_k(probs, k)
    else:
        top = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), top.astype(h.dtype), logits


def _swiglu(x, gate, up, down):
    """One expert's (or a batch of tiles') SwiGLU: x [..., m, D], weights [..., D, F] / [..., F, D]."""
    return jnp.matmul(jax.nn.silu(jnp.matmul(x, gate)) * jnp.matmul(x, up), down)


def _dense(x, ids, gates, gate, up, down):
    E = gate.shape[0]
    y = jax.vmap(_swiglu, in_axes=(None, 0, 0, 0))(x, gate, up, down)  # [E, M, D]
    weight = jnp.sum(jax.nn.one_hot(ids, E, dtype=x.dtype) * gates[..., None], axis=1)  # [M, E]
    return jnp.einsum("me,emd->md", weight, y)


def _sorted(ids: jax.Array, E: int):
    """The m*k assignments in expert order: (order [A] (flat assignment index), their experts [A], rows per
    expert [E])."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, flat[order], jnp.bincount(flat, length=E).astype(jnp.int32)


def tile_rows(assignments: int, experts: int) -> int:
    """The tile of `sorted_tiles`: about the rows an expert gets when the load is even, a power of two in
    [8, 128] (small for a decode step's few tokens, so the padding stays small; large for a training forward)."""
    even = max(1, assignments // experts)
    return int(min(128, max(8, 1 << (even - 1).bit_length())))


def _sorted_tiles(x, ids, gates, gate, up, down):
    M, k = ids.shape
    E, A = gate.shape[0], ids.size
    t = tile_rows(A, E)
    tiles = -(-(A + E * (t - 1)) // t)  # enough for every group padded to a tile: static
    order, expert, counts = _sorted(ids, E)
    padded = -(-counts // t) * t
    group_start = jnp.cumsum(padded) - padded  # each expert's first row in the buffer
    first = jnp.cumsum(counts) - counts  # each expert's first assignment in sorted order
    rank = jnp.arange(A) - first[expert]  # an assignment's place in its expert's group
    at = group_start[expert] + rank  # [A] its row in the buffer
    rows = jnp.zeros((tiles * t, x.shape[-1]), x.dtype).at[at].set(x[order // k])
    # The expert of each tile: tiles past the last group get the last expert (their rows are zero, unread).
    tile_expert = jnp.clip(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(tiles) * t, side="right"), 0, E - 1)
    y = _swiglu(rows.reshape(tiles, t, -1), gate[tile_expert], up[tile_expert], down[tile_expert])
    y = y.reshape(tiles * t, -1)[at]  # [A, D] in sorted order
    return _combine(y, order, gates, M, k)


def _megablox(x, ids, gates, gate, up, down):
    """The sorted assignments through the Pallas TPU grouped matmul (`jax.experimental.pallas.ops.tpu.megablox`,
    its own backward): each tile of rows multiplies only its groups' weights, and tiles past the last group's rows
    are not visited, so an assignment with expert id E (one past the last: padding, e.g. expert parallelism's
    static receive buffer) costs nothing and gives a zero row. Elsewhere it runs in Pallas interpret mode (tests
    only: slow). On a mesh it runs per device (`expert_parallel.run_experts`). On a TPU a hidden or expert width
    that is no multiple of 128 (toy models) runs `sorted_tiles` instead."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    interpret = context_platform() != "tpu"
    if not interpret and (x.shape[-1] % 128 or gate.shape[-1] % 128):
        # Mosaic refuses a matmul whose operands are no multiple of the 128 lanes wide ("Bad lhs type", jax 0.10.2):
        # toy widths (tiny test models) run sorted_tiles.
        return _sorted_tiles(x, ids, gates, gate, up, down)
    M, k = ids.shape
    A = M * k
    order, _, counts = _sorted(ids, gate.shape[0])  # padding (id E) sorts last and is in no group
    tm = min(128, -(-A // 8) * 8)  # a row tile: 128, or all rows rounded up to the sublane (8) for few tokens
    padded = -(-A // tm) * tm
    # The kernel leaves rows past the groups' total unwritten (garbage, NaN in interpret mode): zero them, going in
    # (so their gradient is zero too) and coming out.
    real = (jnp.arange(padded) < jnp.sum(counts))[:, None]
    rows = jnp.where(real, jnp.pad(x[order // k], ((0, padded - A), (0, 0))), 0)

    def tiles(m, k, n):  # per call (the backward's calls swap k and n): a whole dim where it is no multiple of 128
        return (min(tm, m), *(128 if d % 128 == 0 else d for d in (k, n)))

    def grouped(lhs, rhs):  # [padded, K] x [E, K, N]
        # Mosaic rejects bf16 matmuls at "highest" precision (a global setting some users and our tests choose:
        # "Bad lhs type"); for bf16 operands the MXU's products are exact at any precision.
        exact = jax.default_matmul_precision("default") if lhs.dtype == jnp.bfloat16 else contextlib.nullcontext()
        with exact:
            out = gmm(lhs, rhs, counts, preferred_element_type=lhs.dtype, tiling=tiles, interpret=interpret)
        return jnp.where(real, out, 0)

    h = jax.nn.silu(grouped(rows, gate)) * grouped(rows, up)
    return _combine(grouped(h, down)[:A], order, gates, M, k)


def _ragged(x, ids, gates, gate, up, down):
    M, k = ids.shape
    order, _, counts = _sorted(ids, gate.shape[0])
    rows = x[order // k]
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, counts)) * jax.lax.ragged_dot(rows, up, counts)
    return _combine(jax.lax.ragged_dot(h, down, counts), order, gates, M, k)


def _combine(y_sorted, order, gates, M: int, k: int):
    """[M, D]: each token's k expert outputs (rows of y_sorted, in expert order) weighted by its gates."""
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(M, k, -1)
    return jnp.einsum("mk,mkd->md", gates, y)


IMPLEMENTATIONS = {"sorted_tiles": _sorted_tiles, "megablox": _megablox, "ragged": _ragged, "dense": _dense}
# Implementations that are a kernel XLA cannot partition: on a mesh they run per device under shard_map.
KERNELS = ("megablox",)


class RouterStats(NamedTuple):
    """A router over a set of tokens, as sums (so layers, streams and micro-batches add up): what the load-balance
    and z losses are computed from (`router_losses`)."""

    assignments: jax.Array  # [..., E] float32 the (token, expert) assignments that ran (under replay: replayed)
    probability: jax.Array  # [..., E] float32 the router's softmax probabilities, summed over the tokens
    z: jax.Array  # [...] float32 logsumexp(router logits)^2, summed over the tokens
    tokens: jax.Array  # [...] float32 the tokens counted

    def scaled(self, factor) -> RouterStats:
        return RouterStats(*(x * factor for x in self))

    def __add__(self, other: RouterStats) -> RouterStats:  # noqa: D105 - stats of two token sets
        return RouterStats(*(a + b for a, b in zip(self, other, strict=True)))


def router_stats(logits, used, token_mask) -> RouterStats:
    """Stats of router `logits` [M, E] float32 with experts `used` [M, k] over the tokens of `token_mask` [M]."""
    weight = token_mask.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    assignments = jnp.zeros(logits.shape[-1], jnp.float32).at[used.reshape(-1)].add(
        jnp.repeat(weight, used.shape[-1]))
    return RouterStats(assignments, jnp.sum(probs * weight[:, None], axis=0),
                       jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * weight), jnp.sum(weight))


def router_losses(stats: RouterStats) -> tuple[jax.Array, jax.Array]:
    """(load-balance loss, z loss) of every layer's tokens pooled (any leading axes are summed). Load balance as
    transformers' `load_balancing_loss_func`: E * sum_e (assignments_e / T) (probability_e / T), k at an even load;
    its gradient reaches the router through the probabilities. z loss (ST-MoE): the mean of logsumexp^2."""
    E = stats.assignments.shape[-1]
    tokens = jnp.maximum(jnp.sum(stats.tokens), 1.0)
    assignments = jnp.sum(stats.assignments.reshape(-1, E), axis=0)
    probability = jnp.sum(stats.probability.reshape(-1, E), axis=0)
    return E * jnp.sum(assignments * probability) / tokens**2, jnp.sum(stats.z) / tokens


def moe_mlp(h: jax.Array, p: dict, *, k: int, norm_topk_prob: bool, impl: str, ids: jax.Array | None = None,
            token_mask: jax.Array | None = None, dispatch: str = "all_gather"):
    """The MoE block on h [B, T, D] with a layer's weights `p` (router [D, E], experts_gate / experts_up
    [E, D, F], experts_down [E, F, D]): (output [B, T, D], the router's top-k experts [B, T, k], its
    `RouterStats` over the tokens of `token_mask` [B, T] (default all)). `ids` [B, T, k]: replay these experts
    instead of the router's top k (`route`); what is returned is still the router's own choice, so a caller can
    count where replay overrode it. On a context mesh with an expert axis the experts run split over it, tokens
    moved by `dispatch` (models/expert_parallel.py)."""
    B, T, D = h.shape
    x = h.reshape(B * T, D)
    replay = None if ids is None else ids.reshape(B * T, k).astype(jnp.int32)
    used, gates, logits = route(x, p["router"], k, norm_topk_prob, replay)
    weights = ExpertWeights(p["experts_gate"], p["experts_up"], p["experts_down"])
    y = run_experts(IMPLEMENTATIONS[impl], x, used, gates, weights, dispatch, kernel=impl in KERNELS)
    chosen = used if replay is None else jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)[1]
    mask = jnp.ones(B * T, bool) if token_mask is None else token_mask.reshape(B * T)
    return y.reshape(B, T, D), chosen.reshape(B, T, k), router_stats(logits, used, mask)
