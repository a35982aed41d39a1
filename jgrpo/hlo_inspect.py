"""What runs inside a compiled program's loops: big copies and collectives, read from its optimised HLO.

The TPU compiler is a test oracle for the hot loops. A decode step that copies a weight or its KV cache every
token (what once made the CPU sampler slow) shows up as a `copy` inside the decode loop's body whose size is
that of a buffer the loop carries; an FSDP training step's per-layer all-gathers show up inside the layer
scan's body, where they belong only if they gather that layer's weights (and, ideally, asynchronously).
"""

from __future__ import annotations

import dataclasses
import math

from jgrpo.hlo_cost import HloCost, Instruction, _called, _dims, type_bytes

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class LoopOp:
    loop: str  # the while instruction
    trips: int
    opcode: str
    name: str
    type: str
    bytes: int


def _elements(type_: str) -> list[int]:
    return [math.prod(dims) for _, dims in _dims(type_)]


def _walk(cost: HloCost, computation: str, seen: set[str]):
    """Every instruction of `computation` and of what it calls, each once."""
    if computation in seen:
        return
    seen.add(computation)
    for ins in cost.computations[computation]:
        yield ins
        for key in ("calls", "to_apply", "body", "condition", "branch_computations"):
            for called in _called(ins, key):
                if called in cost.computations:
                    yield from _walk(cost, called, seen)


def loops(cost: HloCost) -> list[tuple[Instruction, str, int]]:
    """(while instruction, body computation, trip count) of every loop in the program."""
    found = []
    for computation, body in cost.computations.items():
        for ins in body:
            if ins.opcode == "while":
                found.append((ins, _called(ins, "body")[0], cost.trip_count(computation, ins)))
    return found


def _is_copy(cost: HloCost, ins: Instruction) -> bool:
    if ins.opcode in ("copy", "copy-start"):
        return True
    if ins.opcode == "fusion":  # a fusion that only moves data (its root a copy / transpose of a parameter)
        fused = cost.computations[_called(ins, "calls")[0]]
        movers = {"parameter", "copy", "bitcast", "transpose", "reshape", "tuple", "get-tuple-element"}
        return all(i.opcode in movers for i in fused) and any(i.opcode in ("copy", "transpose") for i in fused)
    return False


def _cost(hlo: str | HloCost) -> HloCost:
    return hlo if isinstance(hlo, HloCost) else HloCost(hlo)


def big_copies_in_loops(hlo: str | HloCost, min_bytes: int = 1 << 16) -> list[LoopOp]:
    """Copies inside a loop body of a buffer the loop carries (a weight, a KV cache) of at least `min_bytes`."""
    cost = _cost(hlo)
    found = []
    for loop, body, trips in loops(cost):
        carried = cost.computations[body][0].type if cost.computations[body] else ""
        params = [i for i in cost.computations[body] if i.opcode == "parameter"]
        carried = params[0].type if params else carried
        sizes = {n for n, (dtype, dims) in zip(_elements(carried), _dims(carried), strict=True)
                 if type_bytes(f"{dtype}[{','.join(map(str, dims))}]") >= min_bytes}
        for ins in _walk(cost, body, set()):
            if _is_copy(cost, ins) and any(n in sizes for n in _elements(ins.type)):
                found.append(LoopOp(loop.name, trips, ins.opcode, ins.name, ins.type, type_bytes(ins.type)))
    return found


def collectives_in_loops(hlo: str | HloCost) -> list[LoopOp]:
    """Collectives inside loop bodies (fusions and nested loops included), with the bytes each one outputs."""
    cost = _cost(hlo)
    found = []
    for loop, body, trips in loops(cost):
        for ins in _walk(cost, body, set()):
            base = ins.opcode.removesuffix("-start").removesuffix("-done")
            if base in COLLECTIVES and not ins.opcode.endswith("-done"):
                found.append(LoopOp(loop.name, trips, ins.opcode, ins.name, ins.type, type_bytes(ins.type)))
    return found


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
    }
