"""Which copy of the weights a compiled sampler's decode step reads, and how many bytes of each element type; and
how many bytes of its KV cache (`decode_cache_bytes`).

A decode step is HBM-bound: what it reads per token is the sampler's speed. The weights it reads need not be the
program's arguments: XLA hoists loop-invariant work out of the decode loop (a cast of float32 weights to the
bfloat16 compute dtype, measured: docs/tpu_plans.md; on the tiny model even the per-layer slices, made once by
the prefill's layer scan), and the loop then reads that copy. So the weights are found by data flow: a value is
"weights" when it is computed from the weight arguments (and constants, loop counters) only, never from the
prompts or the key. The prompt's KV cache, computed from weights *and* prompts, is not weights.

`decode_weight_bytes(hlo, weight_parameters)` walks the program once (loops to their fixed point, fusions through
their bodies), then counts what one trip of the decode loop (the top-level loop with the most trips) reads of
weight values, by element type, every layer of a nested layer scan included: e.g. `{"bf16": 988_000_000}`. A copy
of weights made inside the loop (a layer's slice materialised for a Pallas call, which cannot fuse the slice) is
weights too: its source and the copy are both read, so the figure exceeds the weights' size exactly by what the
step re-reads.
"""

from __future__ import annotations

import collections
import re

from jgrpo.planning.hlo_cost import FREE_OPCODES, SLICING_OPCODES, HloCost
from jgrpo.planning.hlo_inspect import loops
from jgrpo.planning.hlo_text import Instruction, array_dims, called_computations, hbm_bytes, type_bytes

# A value's origin: from nothing that varies (constants, counters), from the weights only, or from anything else.
NONE, WEIGHTS, OTHER = 0, 1, 2
_NEUTRAL = {"constant", "iota", "partition-id", "replica-id", "after-all"}
_INDEX = re.compile(r"index=(\d+)")
_CONCAT_BITCAST = 'custom_call_target="ConcatBitcast"'
_CACHE_TYPES = {"f32", "bf16", "f16", "s8", "f8e4m3fn", "f8e5m2"}  # a KV cache's element types (int8: with f32 scales)


def _join(*taints) -> int:
    flat = [t for taint in taints for t in (taint if isinstance(taint, list) else [taint])]
    return max(flat, default=NONE)


class _Flow:
    """Origins of every value of a program (per computation, for the operands it was last evaluated with)."""

    def __init__(self, cost: HloCost):
        self.cost = cost
        self.values: dict[str, dict[str, int | list]] = {}  # computation -> instruction -> taint
        self.loop_state: dict[str, list] = {}  # while body -> its carried elements' taints at the fixed point

    def evaluate(self, computation: str, inputs: dict[int, int | list]) -> int | list:
        """Taints of `computation`'s instructions given its parameters' (by parameter number); returns its root's."""
        values: dict[str, int | list] = {}
        for ins in self.cost.computations[computation]:
            values[ins.name] = self._instruction(ins, values, inputs)
        self.values[computation] = values
        return values[self.cost.computations[computation][-1].name]

    def _instruction(self, ins: Instruction, values: dict, inputs: dict) -> int | list:
        operands = [values.get(o, NONE) for o in ins.operands]
        if ins.opcode == "parameter":
            return inputs.get(int(ins.operands[0]), OTHER)
        if ins.opcode in _NEUTRAL:
            return NONE
        if ins.opcode == "tuple":
            return operands
        if ins.opcode == "get-tuple-element":
            source = operands[0] if operands else NONE
            index = int(_INDEX.search(ins.attributes).group(1))
            return source[index] if isinstance(source, list) and index < len(source) else _join(source)
        if ins.opcode == "while":
            return self._loop(ins, operands[0])
        if ins.opcode in ("fusion", "call"):
            called = called_computations(ins, "calls") or called_computations(ins, "to_apply")
            return self.evaluate(called[0], dict(enumerate(operands)))
        return _join(*operands)

    def _loop(self, ins: Instruction, init) -> list:
        """The carried elements' taints at the loop's fixed point: what they start as, joined with what a trip
        makes of them, until nothing changes (taints only grow, so a few trips)."""
        body = called_computations(ins, "body")[0]
        state = list(init) if isinstance(init, list) else [init]
        for _ in range(len(state) + 2):
            root = self.evaluate(body, {0: state})
            new = [_join(s, r) for s, r in zip(state, root if isinstance(root, list) else [root] * len(state),
                                               strict=False)]
            if new == state:
                break
            state = new
        self.evaluate(body, {0: state})
        self.loop_state[body] = state
        return state


def _decode_loops(cost: HloCost) -> list[str]:
    """The bodies of the decode loops: the top-level loops with the most trips (the prefill's layer scan has fewer),
    one per number of cache chunks a step reads."""
    top = [(body, trips) for ins, body, trips in loops(cost) if ins in cost.computations[cost.entry]]
    most = max((trips for _, trips in top), default=0)
    return [body for body, trips in top if trips == most]


def decode_weight_bytes(hlo: str | HloCost, weight_parameters: set[int]) -> dict[str, int]:
    """Bytes of weight values (computed from the entry parameters `weight_parameters` only) one trip of the decode
    loop reads, by element type (any memory space; `FREE_OPCODES` bookkeeping reads nothing). A conditional's
    branches (continuous batching's refill, not a per-token cost) are not counted."""
    cost = hlo if isinstance(hlo, HloCost) else HloCost(hlo)
    bodies = _decode_loops(cost)
    if not bodies:
        return {}
    flow = _Flow(cost)
    flow.evaluate(cost.entry, {n: WEIGHTS for n in weight_parameters})

    def weights(computation: str) -> set[str]:
        flow.evaluate(computation, {0: flow.loop_state[computation]})  # its values at the loop's fixed point
        return {name for name, taint in flow.values[computation].items() if taint == WEIGHTS}

    return _reads(cost, bodies[0], weights)  # every decode loop reads the weights alike


def decode_cache_bytes(hlo: str | HloCost, weight_parameters: set[int], head_dim: int) -> dict[str, int]:
    """Bytes of KV cache the last decode step reads (the costliest trip of a top-level loop), by element type:
    e.g. `{"bf16": ...}`, or with an int8 cache `{"f32": ..., "s8": ...}` (values and their per-token scales). The
    cache is what the decode loop carries from step to step, not weights, as float or int8 arrays whose last dim is
    head_dim (keys, values) or 1 (int8 scales), read where they lie or once moved (XLA may merge other dims:
    [S, KVH, P, Dh] carried as [S, KVH * P, Dh], its scales as [S, KVH * P]). A loop inside a step (the layer
    scan, the paged attention's block loop) holds the cache where its parent hands it the cache, never a value of
    the step that merely has head_dim (a query, an attention accumulator). A chunk written in place is not read
    (`HloCost.parameter_reads`)."""
    cost = hlo if isinstance(hlo, HloCost) else HloCost(hlo)
    flow = _Flow(cost)
    flow.evaluate(cost.entry, {n: WEIGHTS for n in weight_parameters})
    found_in: dict[str, set[str]] = {}

    def carried(body: str) -> dict[int, Instruction]:
        state = {i.name for i in cost.computations[body] if i.opcode == "parameter"}
        return {int(_INDEX.search(i.attributes).group(1)): i for i in cost.computations[body]
                if i.opcode == "get-tuple-element" and i.operands[0] in state}

    def decode_loop_cache(body: str) -> set[str]:
        flow.evaluate(body, {0: flow.loop_state[body]})
        taints = flow.values[body]
        arrays = {i.name: array_dims(i.type)[0] for i in carried(body).values()
                  if taints[i.name] != WEIGHTS and len(array_dims(i.type)) == 1
                  and array_dims(i.type)[0][0] in _CACHE_TYPES}
        # Int8 scales: [..., 1], or with the 1 dropped as an int8 array's dims but its last ([S, KVH * P]).
        int8_rows = {dims[:-1] for dtype, dims in arrays.values() if dtype == "s8" and dims[-1:] == (head_dim,)}
        return {name for name, (dtype, dims) in arrays.items()
                if dims[-1:] == (head_dim,) or (dtype == "f32" and (dims[-1:] == (1,) or dims in int8_rows))}

    def walk(body: str, found: set[str]) -> None:
        types = {i.name: i.type for i in cost.computations[body]}
        by_name = {i.name: i for i in cost.computations[body]}
        for ins in cost.computations[body]:
            # The cache after a step's in-place write (a dynamic-update-slice, fused or not: the same array type
            # out as in), bitcast, or moved ahead of its reader (as weights are).
            if ins.operands and ins.operands[0] in found and (
                    array_dims(ins.type) == array_dims(types[ins.operands[0]]) or ins.opcode == "bitcast"
                    or ins.opcode.endswith(("-start", "-done")) or _CONCAT_BITCAST in ins.attributes):
                found.add(ins.name)
        found_in[body] = found
        for ins in cost.computations[body]:
            if ins.opcode != "while":
                continue
            inner = called_computations(ins, "body")[0]
            init = by_name.get(ins.operands[0])
            handed = ({n for n, operand in enumerate(init.operands) if operand in found}
                      if init is not None and init.opcode == "tuple" else set())
            walk(inner, {i.name for n, i in carried(inner).items() if n in handed})

    # The last decode loop's step reads the most chunks.
    steps = []
    for body in _decode_loops(cost):
        walk(body, decode_loop_cache(body))
        steps.append(_reads(cost, body, lambda computation: found_in.get(computation, set())))
    return max(steps, key=lambda reads: sum(reads.values()), default={})


def _reads(cost: HloCost, body: str, selected) -> dict[str, int]:
    reads: collections.Counter = collections.Counter()
    _count(cost, body, 1, reads, selected)
    return {dtype: int(n) for dtype, n in sorted(reads.items())}


def _count(cost: HloCost, computation: str, trips: int, reads: collections.Counter, selected) -> None:
    """Add what one trip of the loop body `computation` reads of the values `selected(computation)` names, `trips`
    times (its own loops counted with their trips)."""
    chosen = selected(computation)
    types = {i.name: i.type for i in cost.computations[computation]}
    counted: set[str] = set()  # instructions of this body whose reads of the values were counted
    for ins in cost.computations[computation]:
        if ins.opcode == "while":
            _count(cost, called_computations(ins, "body")[0], trips * cost.trip_count(computation, ins), reads,
                   selected)
            continue
        # An async copy or slice ("-start" / "-done") moves weights, e.g. into on-chip memory ahead of a matmul: the
        # consumer's read of what it moved is the read (counted at the moved size, once); counting the move too
        # would count the bytes twice, and the whole source once per slice.
        # The TPU's "ConcatBitcast" joins such slices where they landed: a bitcast, nothing read.
        if ins.opcode == "bitcast" and ins.operands[0] in counted:
            counted.add(ins.name)  # a view of a copy made in this step
        if ins.opcode in FREE_OPCODES or ins.opcode.endswith(("-start", "-done")) or _CONCAT_BITCAST in ins.attributes:
            continue
        for position, operand in enumerate(ins.operands):
            if operand not in chosen or operand not in types:
                continue
            if operand in counted and not hbm_bytes(types[operand]):
                # A copy this step made in on-chip memory (a layer's slice, re-laid out for its matmul in a
                # scanned decode): its source was counted where the copy read it; reading it moves no HBM bytes.
                continue
            counted.add(ins.name)
            if ins.opcode == "fusion":
                fused = called_computations(ins, "calls")[0]
                params = [p for p in cost.computations[fused] if p.opcode == "parameter"
                          and p.operands == (str(position),)]
                size = cost.parameter_reads(fused, params[0]) if params else type_bytes(types[operand])
            elif ins.opcode == "dynamic-update-slice" and position == 0:
                size = 0  # written in place: only the update is read
            elif ins.opcode in SLICING_OPCODES and position == 0:
                size = min(type_bytes(types[operand]), type_bytes(ins.type))
            else:
                size = type_bytes(types[operand])
            reads[array_dims(types[operand])[0][0]] += trips * size
