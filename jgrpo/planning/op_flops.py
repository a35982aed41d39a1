"""The FLOPs of one HLO instruction: a `dot`, a `convolution` (TPU HLO's batched matmul, counting only the window
positions on real input, as XLA's own cost analysis does), or a Pallas kernel (its author's `cost_estimate`;
splash attention, which has none in jax 0.10.2, from the blocks its mask computes).
"""

from __future__ import annotations

import math
import re

from jgrpo.planning.hlo_text import Instruction, array_dims, shape_of

_KERNEL_ESTIMATE = re.compile(r'cost_estimate\\?"\s*:\s*\{([^}]*)\}')
# Splash attention's three kernels (forward, dq, dk/dv) and the FLOPs per computed (query, key) pair per head
# dimension: the forward's q.k and p.v; dq recomputes q.k, then dO.v and dS.k; dk/dv recomputes q.k, then
# dO.v, p.dO and dS.q (2 FLOPs per multiply-add).
_SPLASH = re.compile(r"splash_m[hq]a_(fwd|dq|dkv)")
_SPLASH_FLOPS_PER_PAIR = {"fwd": 4, "dq": 6, "dkv": 8}
_SPLASH_BLOCKS = {"fwd": ("block_q", "block_kv"), "dq": ("block_q_dq", "block_kv_dq"),
                  "dkv": ("block_q_dkv", "block_kv_dkv")}


def kernel_estimate(ins: Instruction, key: str) -> float | None:
    """A Pallas kernel's own estimate of its `key` ("flops", "bytes_accessed"), None when it gives none."""
    if ins.opcode != "custom-call" or "tpu_custom_call" not in ins.attributes:
        return None
    estimate = _KERNEL_ESTIMATE.search(ins.attributes)
    value = estimate and re.search(rf'{key}\\?"\s*:\s*\\?"?(\d+)', estimate.group(1))
    return float(value.group(1)) if value else None


def causal_block_pairs(q_len: int, kv_len: int, block_q: int, block_kv: int) -> int:
    """(query, key) pairs a block-sparse kernel computes for a causal mask whose queries are the last `q_len` of
    `kv_len` keys: every element of each block holding at least one allowed pair (the masked-out part of a
    diagonal block is computed too)."""
    offset = kv_len - q_len
    kv_blocks = -(-kv_len // block_kv)
    blocks = sum(max(0, min(kv_blocks, (offset + min((i + 1) * block_q, q_len) - 1) // block_kv + 1))
                 for i in range(-(-q_len // block_q)))
    return blocks * block_q * block_kv


def splash_flops(ins: Instruction, types: dict[str, str]) -> float | None:
    """FLOPs of a splash-attention kernel call (None for any other instruction). jgrpo builds splash with two
    masks (`models/attention_backends._splash`): causal with the queries as the last keys, counted as that mask's
    non-empty blocks, or a mask per row given as data (a "dynamic" one, the packed forward's), whose skipped blocks
    depend on the batch: counted as every block (the worst case, as the planner sizes memory). Read from q
    [..., Tq, Dh] and k [..., S, Dh] (its first two floating operands, after the integer mask tables) and the block
    sizes the kernel records in its metadata (None without them)."""
    kernel = ins.opcode == "custom-call" and "tpu_custom_call" in ins.attributes and _SPLASH.search(ins.attributes)
    if not kernel:
        return None
    floats = [o for o in ins.operands if array_dims(types.get(o, ""))[:1]
              and array_dims(types[o])[0][0] in ("bf16", "f16", "f32")]
    sizes = [re.search(rf'{key}\\*"\s*:\s*(\d+)', ins.attributes) for key in _SPLASH_BLOCKS[kernel.group(1)]]
    if len(floats) < 2 or not all(sizes):
        return None
    q, k = shape_of(types[floats[0]]), shape_of(types[floats[1]])
    block_q, block_kv = (int(m.group(1)) for m in sizes)
    if "dynamic_sparsity_splash" in ins.attributes:  # the named scope jax's kernel traces a data mask under
        pairs = -(-q[-2] // block_q) * block_q * -(-k[-2] // block_kv) * block_kv
    else:
        pairs = causal_block_pairs(q[-2], k[-2], block_q, block_kv)
    return float(math.prod(q[:-2]) * pairs * q[-1] * _SPLASH_FLOPS_PER_PAIR[kernel.group(1)])


def dot_flops(ins: Instruction, types: dict[str, str]) -> int:
    lhs = shape_of(types[ins.operands[0]])
    match = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attributes)
    contracted = math.prod(lhs[int(d)] for d in match.group(1).split(",") if d) if match else 1
    return 2 * math.prod(shape_of(ins.type)) * contracted


def _window_hits(out_size: int, in_size: int, size: int, stride: int, pad_low: int, lhs_dilate: int,
                 rhs_dilate: int) -> int:
    """(output position, window position) pairs of one spatial dimension that read a real input element."""
    span = (in_size - 1) * lhs_dilate + 1
    hits = 0
    for o in range(out_size):
        for k in range(size):
            pos = o * stride - pad_low + k * rhs_dilate
            hits += 0 <= pos < span and pos % lhs_dilate == 0
    return hits


def convolution_flops(ins: Instruction, types: dict[str, str]) -> int:
    lhs, rhs, out = shape_of(types[ins.operands[0]]), shape_of(types[ins.operands[1]]), shape_of(ins.type)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attributes)
    lhs_l, rhs_l, out_l = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", ins.attributes)
    fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}

    def per_dim(key: str, default: int, n: int) -> list[int]:
        return [int(x) for x in fields[key].split("x")] if key in fields else [default] * n

    spatial = [c for c in out_l if c.isdigit()]
    n = len(spatial)
    sizes, strides = per_dim("size", 1, n), per_dim("stride", 1, n)
    lhs_dil, rhs_dil = per_dim("lhs_dilate", 1, n), per_dim("rhs_dilate", 1, n)
    pads = [int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields else [0] * n
    hits = 1
    for i, d in enumerate(spatial):
        hits *= _window_hits(out[out_l.index(d)], lhs[lhs_l.index(d)], sizes[i], strides[i], pads[i],
                             lhs_dil[i], rhs_dil[i])
    return 2 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * hits
