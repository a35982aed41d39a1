"""What a compiled program executes: matmul FLOPs and HBM bytes from its optimised HLO, loops counted.

XLA's `compiled.cost_analysis()` visits a `while` body once, so a scan over 24 layers or a 4096-token decode
loop is undercounted 24x or 4096x (measured: a training step reports the same FLOPs for 2, 12 and 24 layers).
This module reads `compiled.as_text()` (per-device HLO after SPMD partitioning, so every count is per chip) and
multiplies each loop body by its trip count, read from the loop's condition (`counter < N`). A loop that may
stop early (the sampler's decode stops when every row has finished) counts its bound: the worst case. A loop
whose bound is an argument (the packed micro-batches a step uses, `model.packing`) counts `traced_trips`, which
its caller chooses (the worst case or an expected count); without it such a loop is an error.

FLOPs are those of `dot` and `convolution` (the MXU's work, which the chip's peak bf16 rate is quoted for);
TPU HLO expresses batched matmuls as convolutions with padded windows, so a convolution counts only the
window positions that land on real (not padding, not dilation) input, as XLA's own cost analysis does.
Bytes are HBM traffic at fusion granularity: each top-level instruction reads its operands and writes its
output once; an in-place dynamic-update-slice (a KV-cache write) moves the update, not the whole buffer.

A Pallas kernel (a `tpu_custom_call`: megablox's grouped matmul, splash attention) is opaque to the HLO: its
FLOPs and bytes are the `cost_estimate` its author attached (serialised in the call's backend config), else no
FLOPs and its operands and output once. Without that, a mixture of experts on megablox showed none of its
experts' matmuls (0.002 of 0.232 routed TFLOP per chip in a 128-expert layer's forward and backward). Splash
attention's kernels attach none (jax 0.10.2): `splash_flops` counts the blocks they compute (a fifth of a
4096-token update's FLOPs were missing, and "MFU" passed 100%).
"""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")  # a layout's memory space other than 0 (HBM): VMEM, SMEM...
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_INDEX_COMMENT = re.compile(r"/\*.*?\*/")
# Opcodes that move no HBM bytes of their own (bookkeeping, or accounted for in what they call).
FREE_OPCODES = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
                "replica-id", "opt-barrier", "while", "conditional", "call", "iota", "async-update"}
# Ops that read only what they output of their first operand.
SLICING_OPCODES = ("dynamic-slice", "slice", "gather")
_KERNEL_ESTIMATE = re.compile(r'cost_estimate\\?"\s*:\s*\{([^}]*)\}')
# Splash attention's three kernels (forward, dq, dk/dv) and the FLOPs per computed (query, key) pair per head
# dimension: the forward's q.k and p.v; dq recomputes q.k, then dO.v and dS.k; dk/dv recomputes q.k, then
# dO.v, p.dO and dS.q (2 FLOPs per multiply-add).
_SPLASH = re.compile(r"splash_m[hq]a_(fwd|dq|dkv)")
_SPLASH_FLOPS_PER_PAIR = {"fwd": 4, "dq": 6, "dkv": 8}
_SPLASH_BLOCKS = {"fwd": ("block_q", "block_kv"), "dq": ("block_q_dq", "block_kv_dq"),
                  "dkv": ("block_q_dkv", "block_kv_dkv")}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str  # "f32[8,128]{1,0}" or a tuple "(s32[], bf16[2,64])"
    opcode: str
    operands: tuple[str, ...]
    attributes: str


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group that opens at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced HLO text near: {text[start:start + 80]!r}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.groups()
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
    type_, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    close = _balanced(rest, paren)
    # Operands are "%name" or, in unoptimised text, "f32[8] %name": keep the name. Long lists mark every fifth
    # one with its position, "/*index=5*/%name".
    operands = tuple(_INDEX_COMMENT.sub(" ", op).split()[-1].lstrip("%")
                     for op in _split_top_level(rest[paren + 1:close - 1]))
    return Instruction(name, type_, opcode, operands, rest[close:])


def _bracket_state(text: str, state: tuple[int, bool, bool]) -> tuple[int, bool, bool]:
    """(open brackets, inside a string, after a backslash) once `text` is read from `state`: brackets inside
    double-quoted strings do not count."""
    depth, quoted, escaped = state
    for ch in text:
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
    return depth, quoted, escaped


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """HLO module text -> ({computation name: instructions}, entry computation name).

    An instruction may span several lines: a Pallas kernel's backend config (splash attention's) holds newlines,
    and its continuation lines can start with "}". Lines join until the instruction's brackets close; read as a
    computation's end, the rest of a layer loop's body was lost (its matmuls and the experts' kernels with it).
    """
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    pending, state = None, (0, False, False)  # an instruction whose brackets are still open, and their state
    for line in text.splitlines():
        if pending is not None:
            pending += " " + line
            state = _bracket_state(line, state)
            if state[0] <= 0 and not state[1]:
                instruction = _parse_instruction(pending)
                if instruction is not None:
                    computations[current].append(instruction)
                pending = None
        elif current is None:
            header = _HEADER.match(line)
            if header and not line.startswith("HloModule"):
                current = header.group(1)
                computations[current] = []
                if line.startswith("ENTRY"):
                    entry = current
        elif line.lstrip().startswith("}"):  # "}", or `}, execution_thread=...` (v5p: SparseCore offloads)
            current = None
        else:
            state = _bracket_state(line, (0, False, False))
            if state[0] > 0 or state[1]:
                pending = line
                continue
            instruction = _parse_instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def array_dims(type_: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims, _ in _ARRAY.findall(type_)
            if dtype in _DTYPE_BYTES]


def type_bytes(type_: str) -> int:
    """Bytes of an HLO type (a tuple's elements summed; layouts and tiling ignored)."""
    return int(sum(math.prod(dims) * _DTYPE_BYTES[dtype] for dtype, dims in array_dims(type_)))


def hbm_bytes(type_: str) -> int:
    """Bytes of the arrays of an HLO type that live in HBM (the compiler placed the others on chip)."""
    return int(sum(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
                   for dtype, dims, layout in _ARRAY.findall(type_)
                   if dtype in _DTYPE_BYTES and not _ON_CHIP.search(layout or "")))


def _shape(type_: str) -> tuple[int, ...]:
    return array_dims(type_)[0][1]


def called_computations(instruction: Instruction, key: str) -> list[str]:
    match = re.search(rf"\b{key}=\{{?([^}},]+(?:,\s*%[\w.\-]+)*)\}}?", instruction.attributes)
    return [] if not match else [name.strip().lstrip("%") for name in match.group(1).split(",")]


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
    """FLOPs of a splash-attention kernel call (None for any other instruction). jgrpo builds splash with one
    mask, causal with the queries as the last keys (`models/attention_backends._splash`), so the count is that
    mask's non-empty blocks, read from q [..., Tq, Dh] and k [..., S, Dh] (its first two floating operands, after
    the integer mask tables) and the block sizes the kernel records in its metadata (None without them)."""
    kernel = ins.opcode == "custom-call" and "tpu_custom_call" in ins.attributes and _SPLASH.search(ins.attributes)
    if not kernel:
        return None
    floats = [o for o in ins.operands if array_dims(types.get(o, ""))[:1]
              and array_dims(types[o])[0][0] in ("bf16", "f16", "f32")]
    sizes = [re.search(rf'{key}\\*"\s*:\s*(\d+)', ins.attributes) for key in _SPLASH_BLOCKS[kernel.group(1)]]
    if len(floats) < 2 or not all(sizes):
        return None
    q, k = _shape(types[floats[0]]), _shape(types[floats[1]])
    block_q, block_kv = (int(m.group(1)) for m in sizes)
    pairs = causal_block_pairs(q[-2], k[-2], block_q, block_kv)
    return float(math.prod(q[:-2]) * pairs * q[-1] * _SPLASH_FLOPS_PER_PAIR[kernel.group(1)])


def _dot_flops(ins: Instruction, types: dict[str, str]) -> int:
    lhs = _shape(types[ins.operands[0]])
    match = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attributes)
    contracted = math.prod(lhs[int(d)] for d in match.group(1).split(",") if d) if match else 1
    return 2 * math.prod(_shape(ins.type)) * contracted


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


def _convolution_flops(ins: Instruction, types: dict[str, str]) -> int:
    lhs, rhs, out = _shape(types[ins.operands[0]]), _shape(types[ins.operands[1]]), _shape(ins.type)
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


class HloCost:
    """Loop-aware matmul FLOPs and HBM bytes of one compiled program (per device)."""

    def __init__(self, hlo_text: str, traced_trips: int | None = None):
        self.computations, self.entry = parse_hlo(hlo_text)
        self.traced_trips = traced_trips  # the trips of a loop whose bound is not a constant (see the module)
        self._types = {name: {i.name: i.type for i in body} for name, body in self.computations.items()}
        self._memo: dict[tuple[str, str], float] = {}

    @property
    def flops(self) -> float:
        return self._cost(self.entry, "flops")

    @property
    def bytes(self) -> float:
        return self._cost(self.entry, "bytes")

    def bytes_of(self, computation: str) -> float:
        """HBM bytes of one run of `computation` (a loop body: one trip), its own loops counted."""
        return self._cost(computation, "bytes")

    def trip_count(self, computation: str, ins: Instruction) -> int:
        """Iterations of a loop whose condition is `counter < N` (and perhaps more): (N - start) / step, the step
        read from the body (a bidirectional windowed matmul steps by 2)."""
        condition = self.computations[called_computations(ins, "condition")[0]]
        by_name = {i.name: i for i in condition}
        traced = False
        for c in condition:
            if c.opcode != "compare" or "direction=LT" not in c.attributes:
                continue
            counter, bound = (by_name.get(o) for o in c.operands)
            if counter and bound and counter.opcode == "get-tuple-element" and bound.opcode == "constant":
                index = int(re.search(r"index=(\d+)", counter.attributes).group(1))
                start = self._initial_constant(computation, ins, index)
                step = self._counter_step(called_computations(ins, "body")[0], index)
                return max(-(-(int(bound.operands[0]) - start) // step), 0)
            traced |= bool(counter and bound and bound.opcode == "get-tuple-element")
        if traced and self.traced_trips is not None:  # `counter < bound`, the bound carried in from an argument
            return self.traced_trips
        raise ValueError(f"cannot read the trip count of loop '{ins.name}' (no 'counter < constant' condition)")

    def _counter_step(self, body: str, index: int) -> int:
        """c in the body's `counter <- counter + c` (1 when the update is not of that form)."""
        instructions = self.computations[body]
        by_name = {i.name: i for i in instructions}
        root = instructions[-1]
        update = by_name.get(root.operands[index]) if root.opcode == "tuple" and index < len(root.operands) else None
        if update is None or update.opcode != "add":
            return 1
        for operand in update.operands:
            value = self._value(body, by_name, operand, depth=0)
            other = by_name.get(next((o for o in update.operands if o != operand), ""))
            while other is not None and other.opcode in ("copy", "bitcast", "convert"):  # add(copy(gte), 2)
                other = by_name.get(other.operands[0])
            if value is not None and value > 0 and other is not None and other.opcode == "get-tuple-element" \
                    and f"index={index}" in other.attributes:
                return value
        return 1

    def _initial_constant(self, computation: str, ins: Instruction, index: int) -> int:
        """The loop counter's start: a constant, or where an earlier loop's counter stopped (a decode split into
        several loops carries one counter through all of them), else 0."""
        by_name = {i.name: i for i in self.computations[computation]}
        init = by_name.get(ins.operands[0])
        if init is None or init.opcode != "tuple" or index >= len(init.operands):
            return 0
        return self._value(computation, by_name, init.operands[index], depth=0) or 0

    def _value(self, computation: str, by_name: dict, name: str, depth: int) -> int | None:
        ins = by_name.get(name)
        if ins is None or depth > 16:
            return None
        if ins.opcode == "constant":
            return int(ins.operands[0]) if ins.operands[0].lstrip("-").isdigit() else None
        if ins.opcode in ("copy", "bitcast", "convert"):
            return self._value(computation, by_name, ins.operands[0], depth + 1)
        if ins.opcode == "get-tuple-element":
            index = int(re.search(r"index=(\d+)", ins.attributes).group(1))
            source = by_name.get(ins.operands[0])
            if source is not None and source.opcode == "tuple":
                return self._value(computation, by_name, source.operands[index], depth + 1)
            if source is not None and source.opcode == "while":  # the counter leaves the loop at its bound
                return self._bound(source, index)
        return None

    def _bound(self, loop: Instruction, index: int) -> int | None:
        condition = self.computations[called_computations(loop, "condition")[0]]
        by_name = {i.name: i for i in condition}
        for c in condition:
            if c.opcode == "compare" and "direction=LT" in c.attributes:
                counter, bound = (by_name.get(o) for o in c.operands)
                if (counter and bound and counter.opcode == "get-tuple-element" and bound.opcode == "constant"
                        and f"index={index}" in counter.attributes):
                    return int(bound.operands[0])
        return None

    def _cost(self, computation: str, kind: str) -> float:
        key = (computation, kind)
        if key not in self._memo:
            self._memo[key] = sum(self._instruction_cost(computation, ins, kind)
                                  for ins in self.computations[computation])
        return self._memo[key]

    def _instruction_cost(self, computation: str, ins: Instruction, kind: str) -> float:
        types = self._types[computation]
        if ins.opcode == "while":
            body = called_computations(ins, "body")[0]
            return self.trip_count(computation, ins) * self._cost(body, kind)
        if ins.opcode == "conditional":
            branches = (called_computations(ins, "branch_computations") or
                        called_computations(ins, "true_computation") + called_computations(ins, "false_computation"))
            return max((self._cost(b, kind) for b in branches), default=0.0)
        if ins.opcode == "call":
            return sum(self._cost(c, kind) for c in called_computations(ins, "to_apply"))
        if kind == "flops":
            if ins.opcode == "dot":
                return _dot_flops(ins, types)
            if ins.opcode == "convolution":
                return _convolution_flops(ins, types)
            if ins.opcode == "fusion":
                return sum(self._cost(c, "flops") for c in called_computations(ins, "calls"))
            estimate = kernel_estimate(ins, "flops")
            return estimate if estimate is not None else splash_flops(ins, types) or 0.0
        if ins.opcode in FREE_OPCODES or ins.opcode.endswith("-start"):  # an async op counts at its "-done"
            return 0.0
        if ins.opcode == "fusion":
            return self._fusion_bytes(ins, types)
        estimate = kernel_estimate(ins, "bytes_accessed")
        if estimate is not None:
            return estimate
        if ins.opcode.endswith("-done"):  # a copy, slice or collective: read the source, write the result
            start = types.get(ins.operands[0], "")
            source = min(hbm_bytes(start.split("), ")[0]) if start.startswith("((") else hbm_bytes(start),
                         type_bytes(ins.type))
            return source + hbm_bytes(ins.type)
        reads = [hbm_bytes(types.get(o, "")) for o in ins.operands]
        if ins.opcode in SLICING_OPCODES and reads:  # reads the slice, not the whole operand
            reads[0] = min(reads[0], type_bytes(ins.type))
        if ins.opcode == "dynamic-update-slice":  # in place: reads and writes the update only
            return 2 * reads[1] + sum(reads[2:])
        return sum(reads) + hbm_bytes(ins.type)

    def parameter_reads(self, computation: str, parameter: Instruction) -> int:
        """Bytes a fused computation reads of one parameter: the slices it takes, nothing if it is a buffer
        updated in place, else all of it (nested fusions followed)."""
        fused = self.computations[computation]
        uses = [(i, pos) for i in fused for pos, o in enumerate(i.operands) if o == parameter.name]
        total = 0
        for user, position in uses:
            if user.opcode in SLICING_OPCODES and position == 0:
                total += type_bytes(user.type)
            elif user.opcode == "dynamic-update-slice" and position == 0:
                continue
            elif user.opcode == "fusion":
                inner = called_computations(user, "calls")[0]
                params = [p for p in self.computations[inner]
                          if p.opcode == "parameter" and p.operands == (str(position),)]
                total += self.parameter_reads(inner, params[0]) if params else type_bytes(parameter.type)
            else:
                return type_bytes(parameter.type)
        return min(total, type_bytes(parameter.type)) if uses else type_bytes(parameter.type)

    def _fusion_bytes(self, ins: Instruction, types: dict[str, str]) -> int:
        """A fusion reads each HBM operand once (only the slices it takes of a sliced one) and writes its HBM
        output; a dynamic-update-slice at its root writes the update into the buffer in place."""
        fused_name = called_computations(ins, "calls")[0]
        fused = self.computations[fused_name]
        by_name = {i.name: i for i in fused}
        total = 0
        for p in (i for i in fused if i.opcode == "parameter"):
            operand = types.get(ins.operands[int(p.operands[0])], "") if p.operands[0].isdigit() else ""
            if hbm_bytes(operand):
                total += self.parameter_reads(fused_name, p)
        outputs = [m.group(0) for m in _ARRAY.finditer(ins.type)]
        root = fused[-1]
        roots = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
        for i, output in enumerate(outputs):
            r = roots[i] if i < len(roots) else None
            if r is not None and r.opcode == "dynamic-update-slice" and r.operands[1] in by_name:
                total += min(hbm_bytes(output), type_bytes(by_name[r.operands[1]].type))
            else:
                total += hbm_bytes(output)
        return total
