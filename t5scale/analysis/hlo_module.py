"""A compiled program's HLO text, parsed once into a `Module`: its computations, each a list of
instructions, with the types and sizes of their values. The collective count (hlo.py), the walk
of the call graph (hlo_walk.py) and the kernel reading (kernels.py) all read one Module; a
step's analysis parses its program once (t5scale/analysis/step.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "s2": 1, "u2": 1,
    "f8e4m3": 1, "f8e4m3fn": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "f8e5m2": 1,
    "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4,
    "f64": 8, "s64": 8, "u64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip

NAME_PATTERN = r"%?([\w.\-]+)"  # an instruction's or a computation's name
ARRAY_TYPE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?" + NAME_PATTERN + r"\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?" + NAME_PATTERN + r"\s*=\s*(.*)$")
_OPCODE = re.compile(r"([\w\-]+)\(")
_COMMENT = re.compile(r"/\*.*?\*/")  # `/*index=5*/` in long operand lists
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction, as much of it as the readings need."""

    name: str
    result_type: str
    opcode: str
    operands: tuple[str, ...]  # each as printed: `%x`, or `f32[8]{0} %x`
    attributes: str  # everything after the operand list


@dataclasses.dataclass
class Module:
    """A parsed program. Readers never change it: one Module serves every reading."""

    computations: dict[str, list[Instruction]]
    entry: str | None
    types: dict[str, str]  # instruction name -> result type (names are unique in a module)
    by_name: dict[str, Instruction] = dataclasses.field(default_factory=dict)  # name -> itself
    header: str = ""  # the `HloModule …` line: the program's partitions and replicas


def parse_module(hlo_text: str) -> Module:
    """Split HLO text into its computations (`name (params) -> type { … }` blocks)."""
    lines = hlo_text.splitlines()
    module = Module(computations={}, entry=None, types={}, header=lines[0] if lines else "")
    current: list[Instruction] | None = None
    for line in lines:
        if header := _HEADER.match(line):
            current = module.computations.setdefault(header.group(2), [])
            if header.group(1):
                module.entry = header.group(2)
        elif line.strip() == "}":
            current = None
        elif current is not None and (instruction := parse_instruction(line)):
            current.append(instruction)
            module.types[instruction.name] = instruction.result_type
            module.by_name[instruction.name] = instruction
    return module


def parse_instruction(line: str) -> Instruction | None:
    """The instruction on one line of HLO text, or None if the line holds none."""
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.groups()
    if rest.startswith("("):  # tuple result type
        end = _closing(rest, 0)
        result_type, rest = rest[:end], rest[end:].lstrip()
    else:
        result_type, _, rest = rest.partition(" ")
    opcode = _OPCODE.match(rest)
    if not opcode:
        return None
    end = _closing(rest, opcode.end() - 1)
    operands = tuple(_split_top_level(rest[opcode.end() : end - 1]))
    return Instruction(name, result_type, opcode.group(1), operands, rest[end:])


def _closing(text: str, start: int) -> int:
    """Index just past the bracket group that opens at text[start]."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] in "({[":
            depth += 1
        elif text[index] in ")}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return len(text)


def _split_top_level(text: str) -> list[str]:
    """Comma-separated items of `text`, ignoring commas nested in brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += (char in "({[") - (char in ")}]")
        if char == "," and depth == 0:
            items.append(text[start:index].strip())
            start = index + 1
    items.append(text[start:].strip())
    return [item for item in items if item]


# ---- types ----------------------------------------------------------------------------------


def _dimensions(listed: str) -> tuple[int, ...]:
    """`8,<=64` -> (8, 64): a bounded dynamic dimension at its bound."""
    return tuple(int(d.strip().removeprefix("<=")) for d in listed.split(",") if d.strip())


def shape_bytes(type_text: str) -> int:
    """Bytes of an HLO type such as `f32[8,64]{1,0}`, or of all elements of a tuple type."""
    return sum(
        DTYPE_BYTES[dtype] * math.prod(_dimensions(dims))
        for dtype, dims in ARRAY_TYPE.findall(type_text)
        if dtype in DTYPE_BYTES
    )


def array_shape(type_text: str) -> tuple[str, tuple[int, ...]] | None:
    """(dtype, dimensions) of the first array in a type; None if it holds none."""
    found = ARRAY_TYPE.search(type_text)
    return (found.group(1), _dimensions(found.group(2))) if found else None


def element_count(type_text: str) -> int:
    """Elements of the first array in a type (0 if it holds none)."""
    shape = array_shape(type_text)
    return math.prod(shape[1]) if shape else 0


def dtype_of(type_text: str) -> str | None:
    shape = array_shape(type_text)
    return shape[0] if shape else None


def tuple_elements(type_text: str) -> list[str]:
    """Top-level elements of a tuple type; a non-tuple type is its own single element."""
    type_text = type_text.strip()
    if not type_text.startswith("("):
        return [type_text]
    return _split_top_level(type_text[1 : _closing(type_text, 0) - 1])


# ---- operands and users ---------------------------------------------------------------------


def operand_name(operand: str) -> str:
    """An operand's instruction name."""
    return _COMMENT.sub("", operand).split()[-1].lstrip("%")


def operand_type(operand: str, types: Mapping[str, str]) -> str:
    """An operand's type: printed before its name, else its instruction's result type."""
    operand = _COMMENT.sub("", operand)
    name_at = operand.rfind("%") if "%" in operand else operand.rfind(" ") + 1
    inline_type, name = operand[:name_at].strip(), operand[name_at:].lstrip("%")
    return inline_type or types.get(name, "")


def operand_bytes(operands: Sequence[str], types: Mapping[str, str]) -> int:
    return sum(shape_bytes(operand_type(operand, types)) for operand in operands)


def users_of(instructions: Iterable[Instruction]) -> dict[str, list[tuple[Instruction, int]]]:
    """Each instruction's users among `instructions`, with the operand position each takes."""
    users: dict[str, list[tuple[Instruction, int]]] = {}
    for instruction in instructions:
        for position, operand in enumerate(instruction.operands):
            users.setdefault(operand_name(operand), []).append((instruction, position))
    return users


def custom_call_target(instruction: Instruction) -> str:
    """The target a custom-call names ('' for none)."""
    found = _CUSTOM_CALL_TARGET.search(instruction.attributes)
    return found.group(1) if found else ""
