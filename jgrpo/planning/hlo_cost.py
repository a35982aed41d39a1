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

The text is read by `hlo_text.py`, each instruction's FLOPs counted by `op_flops.py`; this module walks the
computations, loops and fusions.
"""

from __future__ import annotations

import re

from jgrpo.planning.hlo_text import (
    Instruction,
    array_types,
    branch_computations,
    called_computations,
    hbm_bytes,
    parse_hlo,
    type_bytes,
)
from jgrpo.planning.op_flops import convolution_flops, dot_flops, kernel_estimate, splash_flops

# Opcodes that move no HBM bytes of their own (bookkeeping, or accounted for in what they call).
FREE_OPCODES = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
                "replica-id", "opt-barrier", "while", "conditional", "call", "iota", "async-update"}
# Ops that read only what they output of their first operand.
SLICING_OPCODES = ("dynamic-slice", "slice", "gather")
# Ops that only re-lay out (or re-view) a value: element type and count kept.
_RELAYOUT_OPCODES = ("copy", "bitcast")


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
            return max((self._cost(b, kind) for b in branch_computations(ins)), default=0.0)
        if ins.opcode == "call":
            return sum(self._cost(c, kind) for c in called_computations(ins, "to_apply"))
        if kind == "flops":
            if ins.opcode == "dot":
                return dot_flops(ins, types)
            if ins.opcode == "convolution":
                return convolution_flops(ins, types)
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
        return self._value_reads(computation, parameter.name, type_bytes(parameter.type))

    def _value_reads(self, computation: str, name: str, whole: int) -> int:
        """Bytes of a value (`whole` of them) its users in `computation` read: slices, in-place updates, nested
        fusions and re-layouts followed. A re-layout (a `copy` or `bitcast`, or a nested fusion that is only
        those) fused with a slice after it reads the slice, not the whole source: the fused code computes what
        the slice takes (a TPU's scanned int8 decode re-tiles each s8 stack so inside the matmul's fusion)."""
        fused = self.computations[computation]
        uses = [(i, pos) for i in fused for pos, o in enumerate(i.operands) if o == name]
        total = 0
        for user, position in uses:
            if user.opcode in SLICING_OPCODES and position == 0:
                total += type_bytes(user.type)
            elif user.opcode == "dynamic-update-slice" and position == 0:
                continue
            elif user.opcode in _RELAYOUT_OPCODES:
                total += self._value_reads(computation, user.name, whole)
            elif user.opcode == "fusion":
                inner = called_computations(user, "calls")[0]
                params = [p for p in self.computations[inner]
                          if p.opcode == "parameter" and p.operands == (str(position),)]
                if not params:
                    return whole
                if self._relayout_only(inner):
                    total += self._value_reads(computation, user.name, whole)
                else:
                    total += self.parameter_reads(inner, params[0])
            else:
                return whole
        return min(total, whole) if uses else whole

    def _relayout_only(self, computation: str) -> bool:
        """A fused computation of one parameter whose root is that parameter re-laid out (copies, bitcasts)."""
        body = self.computations[computation]
        return (sum(i.opcode == "parameter" for i in body) == 1
                and all(i.opcode == "parameter" or i.opcode in _RELAYOUT_OPCODES for i in body))

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
        outputs = array_types(ins.type)
        root = fused[-1]
        roots = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
        for i, output in enumerate(outputs):
            r = roots[i] if i < len(roots) else None
            if r is not None and r.opcode == "dynamic-update-slice" and r.operands[1] in by_name:
                total += min(hbm_bytes(output), type_bytes(by_name[r.operands[1]].type))
            else:
                total += hbm_bytes(output)
        return total
