"""Collectives of a compiled program, counted and sized from its HLO text, per executed step.

`collective_stats(compiled.as_text())` parses the module into computations, walks the call graph
from the ENTRY computation (t5scale/analysis/hlo_walk.py, which says how often each computation
runs) and counts each collective as often as its computation runs: a collective inside a `while`
loop (the layer scan, the micro-batch loop) appears once in the text but runs trip-count times.
Two things are left out on purpose:

- collectives whose groups hold one device each (size-1 mesh axes) move nothing;
- the `-done` half of an async pair, which is the same collective as its `-start`.

XLA:CPU has no 16-bit collectives: it widens a bf16 all-reduce, reduce-scatter or all-gather to
f32 between two converts. Such a collective — every operand made by a convert from bf16 or f16
— is counted at the width the program asked for, which is what a GPU moves; how many were
widened is given under "widened_by_backend".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from t5scale.analysis.collectives import KINDS, CollectiveOp, Collectives
from t5scale.analysis.hlo_walk import Loop, Walk, fused_body, fused_name, operand_name

_NARROW_FLOATS = ("bf16", "f16")

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "s2": 1, "u2": 1,
    "f8e4m3": 1, "f8e4m3fn": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "f8e5m2": 1,
    "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4,
    "f64": 8, "s64": 8, "u64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip

NAME_PATTERN = r"%?([\w.\-]+)"
ARRAY_TYPE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?" + NAME_PATTERN + r"\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?" + NAME_PATTERN + r"\s*=\s*(.*)$")
_OPCODE = re.compile(r"([\w\-]+)\(")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,\s]+)\]<=")
# Newer XLA: replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'} — the devices (in order) as
# a mesh, each group the devices that differ only along the axes in braces.
# The devices may be given as an iota, reshaped and transposed: device_ids=([2,2,2]T(0,2,1)).
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\(\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\))?\s*\{([^}]*)\}"
)
_COMMENT = re.compile(r"/\*.*?\*/")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction, as much of it as the counting needs."""

    name: str
    result_type: str
    opcode: str
    operands: tuple[str, ...]  # each as printed: `%x`, or `f32[8]{0} %x`
    attributes: str  # everything after the operand list


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instruction]]
    entry: str | None
    types: dict[str, str]  # instruction name -> result type (names are unique in a module)
    by_name: dict[str, Instruction] = dataclasses.field(default_factory=dict)  # name -> itself


def shape_bytes(type_text: str) -> int:
    """Bytes of an HLO type such as `f32[8,64]{1,0}`, or of all elements of a tuple type."""
    total = 0
    for dtype, dims in ARRAY_TYPE.findall(type_text):
        if dtype in DTYPE_BYTES:
            sizes = (int(d.strip().removeprefix("<=")) for d in dims.split(",") if d.strip())
            total += DTYPE_BYTES[dtype] * math.prod(sizes)
    return total


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


def tuple_elements(type_text: str) -> list[str]:
    """Top-level elements of a tuple type; a non-tuple type is its own single element."""
    type_text = type_text.strip()
    if not type_text.startswith("("):
        return [type_text]
    return _split_top_level(type_text[1 : _closing(type_text, 0) - 1])


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


@functools.lru_cache(maxsize=1)  # a step's analysis parses one program several times
def parse_module(hlo_text: str) -> Module:
    """Split HLO text into its computations (`name (params) -> type { … }` blocks). Callers
    read the Module and never change it (it is shared)."""
    module = Module(computations={}, entry=None, types={})
    current: list[Instruction] | None = None
    for line in hlo_text.splitlines():
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


def _groups(listed: str) -> list[list[int]]:
    return [[int(d) for d in g.split(",") if d.strip()] for g in re.findall(r"\{([^}]*)\}", listed)]


def _mesh_group(found: re.Match) -> tuple[int, ...]:
    """The first group of a mesh-form replica_groups."""
    axes = [(name.strip().strip("'"), int(size)) for name, size in
            (entry.split("=") for entry in found.group(1).split(","))]  # fmt: skip
    dims, perm, named = found.group(2), found.group(3), found.group(4)
    within = {name.strip().strip("'") for name in named.split(",") if name.strip()}
    ids = np.arange(math.prod(size for _, size in axes))
    if dims:
        ids = ids.reshape([int(d) for d in dims.split(",")])
        if perm:
            ids = ids.transpose([int(d) for d in perm.split(",")])
    ids = ids.reshape([size for _, size in axes])
    index = tuple(slice(None) if name in within else 0 for name, _ in axes)
    return tuple(int(i) for i in ids[index].reshape(-1))


def group_size(attributes: str) -> int | None:
    """Devices per replica group; None when no groups are given (all devices take part)."""
    if found := _GROUPS_MESH.search(attributes):
        return len(_mesh_group(found))
    if found := _GROUPS_IOTA.search(attributes):
        # Iota form [groups, size]<=[devices], maybe with a transpose: size is the last dim.
        return int(found.group(1).split(",")[-1])
    if (found := _GROUPS_LIST.search(attributes)) and (groups := _groups(found.group(1))):
        return max(len(group) for group in groups)
    return None


def moves_data(instruction: Instruction) -> bool:
    """False for collectives that send nothing: groups of one, or permutes onto themselves."""
    if (pairs := _PAIRS.search(instruction.attributes)) is not None:
        return any(source != target for source, target in _groups(pairs.group(1)))
    size = group_size(instruction.attributes)
    return size is None or size > 1


def collective_kind(opcode: str) -> str | None:
    """`all-gather` for `all-gather` and `all-gather-start`; None for anything else."""
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


def operand_type(operand: str, types: Mapping[str, str]) -> str:
    """An operand's type: printed before its name, else its instruction's result type."""
    operand = _COMMENT.sub("", operand)  # `/*index=5*/%x` in long operand lists
    name_at = operand.rfind("%") if "%" in operand else operand.rfind(" ") + 1
    inline_type, name = operand[:name_at].strip(), operand[name_at:].lstrip("%")
    return inline_type or types.get(name, "")


def operand_bytes(operands: Sequence[str], types: Mapping[str, str]) -> int:
    return sum(shape_bytes(operand_type(operand, types)) for operand in operands)


def result_bytes(instruction: Instruction, done_types: Mapping[str, str]) -> int:
    if not instruction.opcode.endswith("-start"):
        return shape_bytes(instruction.result_type)
    if instruction.name in done_types:  # the `-done` returns exactly the collective's result
        return shape_bytes(done_types[instruction.name])
    elements = tuple_elements(instruction.result_type)
    if collective_kind(instruction.opcode) == "all-reduce" or len(elements) < 2:
        return shape_bytes(instruction.result_type)
    return shape_bytes(elements[1])  # (operands, results, context…)


def dtype_of(type_text: str) -> str | None:
    found = ARRAY_TYPE.search(type_text)
    return found.group(1) if found else None


# Instructions whose result holds their first operand's elements as they were (in another
# layout, shape or tuple): a 16-bit value widened to f32 is still recognised after them. Not
# kernels.py's _MOVES_ONLY (what a copy kernel is made of): a slice or a pad moves data too, but
# its result holds other elements than its operand.
_SAME_ELEMENTS = ("copy", "bitcast", "transpose", "reshape", "get-tuple-element")


def users_of(module: Module) -> dict[str, list[tuple[Instruction, int]]]:
    """Each instruction's users anywhere in the module, with the operand position it takes."""
    users: dict[str, list[tuple[Instruction, int]]] = {}
    for body in module.computations.values():
        for instruction in body:
            for position, operand in enumerate(instruction.operands):
                users.setdefault(operand_name(operand), []).append((instruction, position))
    return users


def _fusion_parameter(fusion: Instruction, position: int, module: Module) -> Instruction | None:
    """The parameter of a fusion's computation that its operand at `position` becomes."""
    return next(
        (inner for inner in fused_body(fusion, module.computations)
         if inner.opcode == "parameter" and inner.operands == (str(position),)),
        None,
    )  # fmt: skip


class _Widening:
    """Recognises the converts XLA:CPU puts around a 16-bit collective that it runs in f32: a
    16-bit value widened to f32 on the way in, the f32 result narrowed back on the way out."""

    def __init__(self, module: Module, users: dict[str, list[tuple[Instruction, int]]]):
        self.module, self.by_name, self.users = module, module.by_name, users

    def widened(self, instruction: Instruction) -> bool:
        operands = [self.by_name.get(operand_name(operand)) for operand in instruction.operands]
        return (
            bool(operands)
            and all(self._widens_16_bits(source) for source in operands)
            and self._narrowed(instruction.name, depth=0)
        )

    def _widens_16_bits(self, value: Instruction | None) -> bool:
        """Whether `value` is a 16-bit value converted to f32 (moved at most, maybe inside a
        fusion, whose root is printed last)."""
        if value is not None and value.opcode == "fusion":
            body = fused_body(value, self.module.computations)
            value = body[-1] if body else None
            local = {inner.name: inner for inner in body}
        else:
            local = self.by_name
        while value is not None and value.opcode in _SAME_ELEMENTS and value.operands:
            value = local.get(operand_name(value.operands[0]))
        if value is None or value.opcode != "convert" or not value.operands:
            return False
        return (
            dtype_of(self.module.types.get(operand_name(value.operands[0]), "")) in _NARROW_FLOATS
        )

    def _narrowed(self, name: str, depth: int) -> bool:
        """Whether every use of `name` converts it back to 16 bits (moved at most, maybe as a
        fusion's parameter)."""
        users = self.users.get(name, [])
        if not users or depth > 8:
            return False
        for user, position in users:
            if user.opcode == "convert":
                if dtype_of(user.result_type) not in _NARROW_FLOATS:
                    return False
            elif user.opcode in _SAME_ELEMENTS or user.opcode.endswith("-done"):
                if not self._narrowed(user.name, depth + 1):
                    return False
            elif user.opcode == "fusion":
                parameter = _fusion_parameter(user, position, self.module)
                if parameter is None or not self._narrowed(parameter.name, depth + 1):
                    return False
            else:
                return False
        return True


class _Slicing:
    """Recognises a reduce-scatter XLA:TPU writes as an all-reduce whose every use is a
    dynamic-slice of at most 1/N of it (N the group's devices), maybe inside a fusion: each
    device keeps its share of the sum, as a reduce-scatter's result, though the instruction
    is an all-reduce."""

    def __init__(self, module: Module, users: dict[str, list[tuple[Instruction, int]]]):
        self.module, self.users = module, users

    def sliced_bytes(self, instruction: Instruction, devices: int) -> int:
        """The all-reduce's operand bytes whose sum each device keeps only a 1/`devices`
        share of (all of them, some elements of a tuple all-reduce, or none)."""
        elements = tuple_elements(instruction.result_type)
        if len(elements) < 2:
            return (
                shape_bytes(instruction.result_type)
                if self._kept_share(
                    instruction.name, _elements(instruction.result_type), devices, 0
                )
                else 0
            )
        sliced = 0
        for user, _ in self.users.get(instruction.name, []):
            index = re.search(r"index=(\d+)", user.attributes)
            if user.opcode != "get-tuple-element" or index is None:
                return 0  # the tuple is used whole somewhere
            element = elements[int(index.group(1))]
            if self._kept_share(user.name, _elements(element), devices, 0):
                sliced += shape_bytes(element)
        return sliced

    def padded_part(self, instruction: Instruction, devices: int) -> bool:
        """Whether an all-reduce is XLA:TPU's all-gather over a large group: each device writes
        its 1/`devices` part into zeros (a dynamic-update-slice of a broadcast 0, maybe as a
        fusion's root) and the all-reduce sums the parts into the whole."""
        if len(instruction.operands) != 1 or len(tuple_elements(instruction.result_type)) > 1:
            return False
        by_name = self.module.by_name
        value = fusion = by_name.get(_through_moves(instruction.operands[0], by_name))
        if value is not None and value.opcode == "fusion":
            body = fused_body(value, self.module.computations)
            value = body[-1] if body else None
        if value is None or value.opcode != "dynamic-update-slice" or len(value.operands) < 2:
            return False
        base = by_name.get(_through_moves(value.operands[0], by_name))
        if base is not None and base.opcode == "parameter" and fusion is not None:
            position = int(base.operands[0])  # the fusion's operand that parameter is
            base = by_name.get(_through_moves(fusion.operands[position], by_name))
        zero = base is not None and base.opcode == "broadcast" and bool(base.operands)
        zero = zero and _is_zero(by_name.get(_through_moves(base.operands[0], by_name)))
        part = _elements(operand_type(value.operands[1], self.module.types))
        return zero and part * devices == _elements(instruction.result_type)

    def _kept_share(self, name: str, total: int, devices: int, depth: int) -> bool:
        users = self.users.get(name, [])
        if not users or depth > 8:
            return False
        for user, position in users:
            if user.opcode == "dynamic-slice":
                if position != 0 or _elements(user.result_type) * devices > total:
                    return False
            elif user.opcode in ("bitcast", "copy") or user.opcode.endswith("-done"):
                if not self._kept_share(user.name, total, devices, depth + 1):
                    return False
            elif user.opcode == "fusion":
                parameter = _fusion_parameter(user, position, self.module)
                if parameter is None or not self._kept_share(
                    parameter.name, total, devices, depth + 1
                ):
                    return False
            else:
                return False
        return True


_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def marked_computations(module: Module, target: str) -> set[str]:
    """The computations holding a custom-call to `target`: XLA:TPU marks the fused computation
    that starts an async collective with AsyncCollectiveStart, the one that ends it with
    AsyncCollectiveDone."""
    return {
        name
        for name, body in module.computations.items()
        if any(
            i.opcode == "custom-call"
            and (found := _CUSTOM_TARGET.search(i.attributes))
            and found.group(1) == target
            for i in body
        )
    }


def async_copies(module: Module) -> set[str]:
    """Computations whose collectives are copies of an XLA:TPU async collective already counted:
    an async collective runs as a fusion marked AsyncCollectiveStart (counted there), one marked
    AsyncCollectiveDone, and fusions in between that take the start's results and print the
    collective again ("continuations"); only the start is counted."""

    by_name, callee = module.by_name, fused_name
    starts = marked_computations(module, "AsyncCollectiveStart")
    copies = marked_computations(module, "AsyncCollectiveDone")
    if not starts:
        return copies
    fusions = [i for i in by_name.values() if i.opcode == "fusion" and callee(i) not in starts]
    in_flight = {i.name for i in by_name.values() if i.opcode == "fusion" and callee(i) in starts}
    grown = True
    while grown:  # continuations of continuations
        grown = False
        for fusion in fusions:
            if fusion.name in in_flight:
                continue
            if any(_through_moves(operand, by_name) in in_flight for operand in fusion.operands):
                in_flight.add(fusion.name)
                copies.add(callee(fusion))
                grown = True
    return copies


def _through_moves(operand: str, by_name: Mapping[str, Instruction]) -> str:
    """The instruction an operand comes from, through tuple elements, bitcasts and copies."""
    name = operand_name(operand)
    for _ in range(8):
        value = by_name.get(name)
        if value is None or value.opcode not in ("get-tuple-element", "bitcast", "copy"):
            break
        name = operand_name(value.operands[0])
    return name


def _is_zero(value: Instruction | None) -> bool:
    if value is None or value.opcode != "constant" or len(value.operands) != 1:
        return False
    try:
        return float(value.operands[0]) == 0.0
    except ValueError:
        return False


def _elements(type_text: str) -> int:
    found = ARRAY_TYPE.search(type_text)
    if found is None:
        return 0
    return math.prod(int(d) for d in found.group(2).split(",") if d.strip())


def async_done_types(module: Module) -> dict[str, str]:
    """Result type of each async `-done`, keyed by the name of the `-start` it completes."""
    done = {}
    for instructions in module.computations.values():
        for instruction in instructions:
            if instruction.opcode.endswith("-done") and instruction.operands:
                done[operand_name(instruction.operands[0])] = instruction.result_type
    return done


def first_group(attributes: str) -> tuple[int, ...] | None:
    """The first replica group (device positions), from either of HLO's spellings; the first
    source-target pair for a collective-permute; None when all devices take part."""
    if found := _GROUPS_MESH.search(attributes):
        return _mesh_group(found)
    if found := _GROUPS_IOTA.search(attributes):
        # [groups, size]<=[dims] with an optional T(perm): iota over dims, transposed, reshaped.
        shape = [int(d) for d in found.group(1).split(",")]
        tail = attributes[found.end() :]
        dims = [int(d) for d in re.match(r"\[([\d,\s]+)\]", tail).group(1).split(",")]
        perm = re.match(r"\[[\d,\s]+\]T\(([\d,\s]+)\)", tail)
        ids = np.arange(math.prod(dims)).reshape(dims)
        if perm:
            ids = ids.transpose([int(d) for d in perm.group(1).split(",")])
        return tuple(int(i) for i in ids.reshape(shape)[0])
    for pattern in (_GROUPS_LIST, _PAIRS):
        if (found := pattern.search(attributes)) and (groups := _groups(found.group(1))):
            return tuple(groups[0])
    return None


def mesh_axes(group: Sequence[int] | None, mesh: Mapping[str, int]) -> set[str]:
    """The mesh axes along which a replica group's devices differ (all of them for None)."""
    if group is None:
        return {axis for axis, size in mesh.items() if size > 1}
    coordinates = np.array(np.unravel_index(group, tuple(mesh.values())))
    return {axis for axis, row in zip(mesh, coordinates, strict=True) if len(set(row)) > 1}


def collective_op(
    instruction: Instruction, computation: str, module: Module, done_types: Mapping[str, str]
) -> CollectiveOp | None:
    """The collective an instruction of `computation` starts, as it runs once (count 1), at
    the bytes it is printed with; None if it is none or moves no data."""
    kind = collective_kind(instruction.opcode)
    if kind is None or not moves_data(instruction):
        return None
    size = result_bytes(instruction, done_types)
    operand = operand_bytes(instruction.operands, module.types)
    return CollectiveOp(kind, 1, size, operand, first_group(instruction.attributes), computation)


def inside_loop(op: CollectiveOp, loop: Loop) -> CollectiveOp:
    """A collective found in the body of `loop`, which is inside the loops it records."""
    return dataclasses.replace(
        op, loops=(loop.trips, *op.loops), loop_names=(loop.name, *op.loop_names)
    )


def collective_ops(hlo_text: str) -> tuple[list[CollectiveOp], Collectives]:
    """Every collective that moves data, with how often it runs per executed step, and their
    totals per kind with notes: loops of unknown trip count (their bodies counted once) and
    collectives XLA:CPU widened (counted at their 16-bit size)."""
    module = parse_module(hlo_text)
    done_types = async_done_types(module)
    users = users_of(module)
    widening, slicing = _Widening(module, users), _Slicing(module, users)
    copies = async_copies(module)
    widened: set[str] = set()
    sliced: set[str] = set()
    padded: set[str] = set()

    def collective(instruction: Instruction, computation: str) -> Counter[CollectiveOp] | None:
        """The collective an instruction is, at its 16-bit size if XLA:CPU widened it, as the
        reduce-scatter it is in effect where XLA:TPU wrote one as an all-reduce and a slice;
        None (walk what it runs) if it is none."""
        if instruction.opcode == "send":
            return dcn_transfer(instruction, computation)
        if (op := collective_op(instruction, computation, module, done_types)) is None:
            return None
        if computation in copies:
            return Counter()
        if widening.widened(instruction):
            widened.add(instruction.name)
            op = dataclasses.replace(op, bytes=op.bytes // 2, operand_bytes=op.operand_bytes // 2)
        devices = group_size(instruction.attributes) or 0
        if op.kind == "all-reduce" and devices > 1:
            if kept := slicing.sliced_bytes(instruction, devices):
                sliced.add(instruction.name)
                return _as_reduce_scatter(op, kept, devices)
            if slicing.padded_part(instruction, devices):
                padded.add(instruction.name)
                gathered = dataclasses.replace(
                    op, kind="all-gather", operand_bytes=op.bytes // devices,
                    form="all-reduce of a zero-padded part",
                )  # fmt: skip
                return Counter({gathered: 1})
        return Counter({op: 1})

    # Keyed by the op as it runs once (count 1); the values count its runs per step.
    walk = Walk(module.computations, collective, inside_loop)
    runs = walk.per_run(module.entry) if module.entry is not None else Counter()
    ops = [dataclasses.replace(op, count=count) for op, count in runs.items() if count]
    notes = len(walk.unknown_loops), len(widened), len(sliced), len(padded)
    return ops, Collectives.of(ops, *notes)


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


def dcn_transfer(send: Instruction, computation: str) -> Counter[CollectiveOp] | None:
    """XLA:TPU's collectives between slices: a host-transfer `send` to its megascale runtime
    that names the collective (ALL_REDUCE…, ONE_TO_ONE for a permute), its payload the first
    element of its result; the `recv` beside it is the same collective. None for any other
    send."""
    found = _MEGASCALE.search(send.attributes)
    kind = found.group(1).lower().replace("_", "-") if found else None
    # A collective permute between slices (a pipeline's stage boundary) is a ONE_TO_ONE.
    kind = "collective-permute" if kind == "one-to-one" else kind
    if kind not in KINDS:
        return None
    payload = shape_bytes(tuple_elements(send.result_type)[0])
    # Every slice takes part: the group is all devices, which spans the axis across slices.
    return Counter({CollectiveOp(kind, 1, payload, payload, None, computation, form="dcn"): 1})


def _as_reduce_scatter(op: CollectiveOp, sliced: int, devices: int) -> Counter[CollectiveOp]:
    """An all-reduce of which `sliced` operand bytes are kept 1/`devices` per device: that
    part as a reduce-scatter written as all-reduce and slice, the rest as the all-reduce."""
    scatter = dataclasses.replace(
        op, kind="reduce-scatter", bytes=sliced // devices, operand_bytes=sliced,
        form="all-reduce+slice",
    )  # fmt: skip
    rest = op.operand_bytes - sliced
    if rest <= 0:
        return Counter({scatter: 1})
    return Counter({scatter: 1, dataclasses.replace(op, bytes=rest, operand_bytes=rest): 1})


def collective_stats(hlo_text: str) -> dict[str, Any]:
    """Per collective kind, `{"count", "bytes", "operand_bytes"}` per device per executed step.

    `bytes` are result bytes, `operand_bytes` input bytes, each summed over tuple elements.
    Kinds that do not occur are absent. If a `while` loop has no known trip count, its body is
    counted once and the number of such loops is given under "unknown_trip_count_loops".
    """
    return collective_ops(hlo_text)[1].to_json()
