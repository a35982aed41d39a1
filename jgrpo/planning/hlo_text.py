"""Optimised HLO text as data: computations of `Instruction`s (name, type, opcode, operands, attributes) and
the arrays of an HLO type (element type, shape, bytes, whether they live in HBM).

`compiled.as_text()` prints one instruction per line, except that a backend config may hold newlines (splash
attention's) and a long operand list names every fifth operand behind an index comment: both are read whole
(tests/planning/test_hlo_cost.py).
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


def array_types(type_: str) -> list[str]:
    """Each array of an HLO type as its own type text ("f32[8,128]{1,0}"): a tuple's elements, in order."""
    return [m.group(0) for m in _ARRAY.finditer(type_)]


def type_bytes(type_: str) -> int:
    """Bytes of an HLO type (a tuple's elements summed; layouts and tiling ignored)."""
    return int(sum(math.prod(dims) * _DTYPE_BYTES[dtype] for dtype, dims in array_dims(type_)))


def hbm_bytes(type_: str) -> int:
    """Bytes of the arrays of an HLO type that live in HBM (the compiler placed the others on chip)."""
    return int(sum(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
                   for dtype, dims, layout in _ARRAY.findall(type_)
                   if dtype in _DTYPE_BYTES and not _ON_CHIP.search(layout or "")))


def shape_of(type_: str) -> tuple[int, ...]:
    return array_dims(type_)[0][1]


def called_computations(instruction: Instruction, key: str) -> list[str]:
    match = re.search(rf"\b{key}=\{{?([^}},]+(?:,\s*%[\w.\-]+)*)\}}?", instruction.attributes)
    return [] if not match else [name.strip().lstrip("%") for name in match.group(1).split(",")]


def branch_computations(conditional: Instruction) -> list[str]:
    """The branches of a `conditional`: indexed (`branch_computations`) or true / false."""
    indexed = called_computations(conditional, "branch_computations")
    two = ("true_computation", "false_computation")
    return indexed or [name for key in two for name in called_computations(conditional, key)]
