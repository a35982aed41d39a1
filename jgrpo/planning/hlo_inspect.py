"""What runs inside a compiled program's loops: big copies and collectives, read from its optimised HLO.

The TPU compiler is a test oracle for the hot loops. A decode step that copies a weight or its KV cache every
token (what once made the CPU sampler slow) shows up as a `copy` inside the decode loop's body whose size is
that of a buffer the loop carries; an FSDP training step's per-layer all-gathers show up inside the layer
scan's body, where they belong only if they gather that layer's weights (and, ideally, asynchronously).
"""

from __future__ import annotations

import dataclasses
import math

from jgrpo.planning.hlo_cost import HloCost
from jgrpo.planning.hlo_text import (
    Instruction,
    array_dims,
    branch_computations,
    called_computations,
    hbm_bytes,
    type_bytes,
)

# A ragged all-to-all (expert parallelism) counts its output buffer, the static worst case: an upper bound of what
# it moves (the rows actually routed).
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class LoopOp:
    loop: str  # the innermost while instruction around it
    trips: int  # how many times it runs per program execution (enclosing trip counts multiplied)
    opcode: str
    name: str
    type: str
    bytes: int


def _elements(type_: str) -> list[int]:
    return [math.prod(dims) for _, dims in array_dims(type_)]


def _cost(hlo: str | HloCost) -> HloCost:
    return hlo if isinstance(hlo, HloCost) else HloCost(hlo)


# Opcodes whose called computation is applied per element (a reduction's or sort's comparator): nothing to walk.
_PER_ELEMENT = ("reduce", "sort", "scatter", "map", "reduce-window", "select-and-scatter")


def _walk(cost: HloCost, computation: str, trips: int, loop: Instruction | None, body: str | None):
    """(computation, instruction, times it runs, innermost loop, that loop's body) for all the program runs."""
    for ins in cost.computations[computation]:
        yield computation, ins, trips, loop, body
        if ins.opcode == "while":
            inner = called_computations(ins, "body")[0]
            yield from _walk(cost, inner, trips * cost.trip_count(computation, ins), ins, inner)
            continue
        for key in ("calls", "to_apply", "branch_computations", "true_computation", "false_computation"):
            for called in called_computations(ins, key):
                if called in cost.computations and ins.opcode not in _PER_ELEMENT:
                    yield from _walk(cost, called, trips, loop, body)


def loops(cost: HloCost) -> list[tuple[Instruction, str, int]]:
    """(while instruction, body computation, trip count) of every loop in the program."""
    found = []
    for computation, body in cost.computations.items():
        for ins in body:
            if ins.opcode == "while":
                found.append((ins, called_computations(ins, "body")[0], cost.trip_count(computation, ins)))
    return found


def _is_hbm_copy(cost: HloCost, ins: Instruction, types: dict[str, str]) -> bool:
    """A copy from HBM to HBM (a layout change or a defensive copy); moves between HBM and on-chip memory
    (the compiler's prefetches, `copy-start` into VMEM) are how TPUs compute, not waste."""
    if ins.opcode == "copy" or (ins.opcode == "fusion" and _moves_only(cost, ins)):
        return hbm_bytes(ins.type) > 0 and all(hbm_bytes(types.get(o, "")) > 0 for o in ins.operands)
    return False


def _moves_only(cost: HloCost, ins: Instruction) -> bool:
    fused = cost.computations[called_computations(ins, "calls")[0]]
    movers = {"parameter", "copy", "bitcast", "transpose", "reshape", "tuple", "get-tuple-element"}
    return all(i.opcode in movers for i in fused) and any(i.opcode in ("copy", "transpose") for i in fused)


def big_copies_in_loops(hlo: str | HloCost, min_bytes: int = 1 << 16) -> list[LoopOp]:
    """HBM-to-HBM copies inside a loop of a buffer the loop carries (a weight, a KV cache) of >= `min_bytes`.

    A copy fused inside another op (e.g. an s8 stack re-tiled for a matmul and sliced by layer, in the same
    fusion) writes nothing to HBM: the fusion computes what its consumer takes (`HloCost.parameter_reads`)."""
    cost = _cost(hlo)
    types = {name: {i.name: i.type for i in body} for name, body in cost.computations.items()}
    fused = {c for body in cost.computations.values() for i in body if i.opcode == "fusion"
             for c in called_computations(i, "calls")}
    found = []
    carried: dict[str, set[int]] = {}
    for scope, ins, trips, loop, body in _walk(cost, cost.entry, 1, None, None):
        if loop is None or scope in fused:
            continue
        if body not in carried:
            params = [i for i in cost.computations[body] if i.opcode == "parameter"]
            carried[body] = {n for n, (dtype, dims) in zip(_elements(params[0].type), array_dims(params[0].type),
                                                           strict=True)
                             if n * type_bytes(f"{dtype}[1]") >= min_bytes} if params else set()
        if _is_hbm_copy(cost, ins, types[scope]) and any(n in carried[body] for n in _elements(ins.type)):
            found.append(LoopOp(loop.name, trips, ins.opcode, ins.name, ins.type, type_bytes(ins.type)))
    return found


def collectives_in_loops(hlo: str | HloCost) -> list[LoopOp]:
    """Collectives inside loop bodies (fusions and nested loops included), with the bytes each one outputs
    and how many times it runs."""
    cost, found = _cost(hlo), []
    for _, ins, trips, loop, _ in _walk(cost, cost.entry, 1, None, None):
        base = ins.opcode.removesuffix("-start").removesuffix("-done")
        if loop is not None and base in COLLECTIVES and not ins.opcode.endswith("-done"):
            found.append(LoopOp(loop.name, trips, ins.opcode, ins.name, ins.type, type_bytes(ins.type)))
    return found


def collective_bytes(hlo: str | HloCost) -> float:
    """Bytes each chip sends over the interconnect per program run, loops counted: a collective's output
    size (an all-reduce moves it twice: reduce-scatter then all-gather). A `conditional` runs one branch: its
    largest (as `HloCost` counts its FLOPs and bytes), not their sum."""
    cost = _cost(hlo)
    return _collective_bytes(cost, cost.entry)


def _collective_bytes(cost: HloCost, computation: str) -> float:
    total = 0.0
    for ins in cost.computations[computation]:
        total += _sent(ins)
        if ins.opcode == "while":
            total += cost.trip_count(computation, ins) * _collective_bytes(cost, called_computations(ins, "body")[0])
        elif ins.opcode == "conditional":
            branches = [b for b in branch_computations(ins) if b in cost.computations]
            total += max((_collective_bytes(cost, b) for b in branches), default=0.0)
        elif ins.opcode not in _PER_ELEMENT:
            called = called_computations(ins, "calls") + called_computations(ins, "to_apply")
            total += sum(_collective_bytes(cost, c) for c in called if c in cost.computations)
    return total


def _sent(ins: Instruction) -> int:
    base = ins.opcode.removesuffix("-start")
    if base not in COLLECTIVES or ins.opcode.endswith("-done"):
        return 0
    return type_bytes(ins.type) * (2 if base == "all-reduce" else 1)


def summary(hlo: str | HloCost) -> dict:
    """Counts for a plan's report: collectives inside loops and their bytes (all trips), big in-loop copies."""
    cost = _cost(hlo)
    collectives = collectives_in_loops(cost)
    copies = big_copies_in_loops(cost)
    return {
        "loop_collectives": len(collectives),
        "loop_collective_bytes": sum(c.bytes * c.trips for c in collectives),
        "loop_all_gathers": sum(c.opcode.startswith("all-gather") for c in collectives),
        "loop_big_copies": [f"{c.name} {c.type.split('{')[0]} x{c.trips}" for c in copies],
        "collective_bytes": collective_bytes(cost),
    }
