"""Collectives of a compiled program, counted and sized from its HLO text, per executed step.

`collective_ops(module)` walks a parsed program (t5scale/analysis/hlo_module.py) from its ENTRY
computation (t5scale/analysis/hlo_walk.py, which says how often each computation runs) and
counts each collective as often as its computation runs: a collective inside a `while` loop
(the layer scan, the micro-batch loop) appears once in the text but runs trip-count times.
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
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from t5scale.analysis.collective_ops import KINDS, CollectiveOp, Collectives
from t5scale.analysis.hlo_module import (
    Instruction,
    Module,
    custom_call_target,
    dtype_of,
    element_count,
    operand_bytes,
    operand_name,
    operand_type,
    shape_bytes,
    tuple_elements,
    users_of,
)
from t5scale.analysis.hlo_walk import Loop, Walk, fused_body, fused_name, fused_parameter

_NARROW_FLOATS = ("bf16", "f16")

_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,\s]+)\]<=")
# Newer XLA: replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'} — the devices (in order) as
# a mesh, each group the devices that differ only along the axes in braces.
# The devices may be given as an iota, reshaped and transposed: device_ids=([2,2,2]T(0,2,1)).
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\(\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\))?\s*\{([^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}")


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


def result_bytes(instruction: Instruction, done_types: Mapping[str, str]) -> int:
    if not instruction.opcode.endswith("-start"):
        return shape_bytes(instruction.result_type)
    if instruction.name in done_types:  # the `-done` returns exactly the collective's result
        return shape_bytes(done_types[instruction.name])
    elements = tuple_elements(instruction.result_type)
    if collective_kind(instruction.opcode) == "all-reduce" or len(elements) < 2:
        return shape_bytes(instruction.result_type)
    return shape_bytes(elements[1])  # (operands, results, context…)


# Instructions whose result holds their first operand's elements as they were (in another
# layout, shape or tuple): a 16-bit value widened to f32 is still recognised after them. Not
# kernels.py's _MOVES_ONLY (what a copy kernel is made of): a slice or a pad moves data too, but
# its result holds other elements than its operand.
_SAME_ELEMENTS = ("copy", "bitcast", "transpose", "reshape", "get-tuple-element")


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
            body = fused_body(value, self.module)
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
                parameter = fused_parameter(fused_body(user, self.module), position)
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
                    instruction.name, element_count(instruction.result_type), devices, 0
                )
                else 0
            )
        sliced = 0
        for user, _ in self.users.get(instruction.name, []):
            index = re.search(r"index=(\d+)", user.attributes)
            if user.opcode != "get-tuple-element" or index is None:
                return 0  # the tuple is used whole somewhere
            element = elements[int(index.group(1))]
            if self._kept_share(user.name, element_count(element), devices, 0):
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
            body = fused_body(value, self.module)
            value = body[-1] if body else None
        if value is None or value.opcode != "dynamic-update-slice" or len(value.operands) < 2:
            return False
        base = by_name.get(_through_moves(value.operands[0], by_name))
        if base is not None and base.opcode == "parameter" and fusion is not None:
            position = int(base.operands[0])  # the fusion's operand that parameter is
            base = by_name.get(_through_moves(fusion.operands[position], by_name))
        zero = base is not None and base.opcode == "broadcast" and bool(base.operands)
        zero = zero and _is_zero(by_name.get(_through_moves(base.operands[0], by_name)))
        part = element_count(operand_type(value.operands[1], self.module.types))
        return zero and part * devices == element_count(instruction.result_type)

    def _kept_share(self, name: str, total: int, devices: int, depth: int) -> bool:
        users = self.users.get(name, [])
        if not users or depth > 8:
            return False
        for user, position in users:
            if user.opcode == "dynamic-slice":
                if position != 0 or element_count(user.result_type) * devices > total:
                    return False
            elif user.opcode in ("bitcast", "copy") or user.opcode.endswith("-done"):
                if not self._kept_share(user.name, total, devices, depth + 1):
                    return False
            elif user.opcode == "fusion":
                parameter = fused_parameter(fused_body(user, self.module), position)
                if parameter is None or not self._kept_share(
                    parameter.name, total, devices, depth + 1
                ):
                    return False
            else:
                return False
        return True


def marked_computations(module: Module, target: str) -> set[str]:
    """The computations holding a custom-call to `target`: XLA:TPU marks the fused computation
    that starts an async collective with AsyncCollectiveStart, the one that ends it with
    AsyncCollectiveDone."""
    return {
        name
        for name, body in module.computations.items()
        if any(i.opcode == "custom-call" and custom_call_target(i) == target for i in body)
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


def collective_ops(module: Module) -> tuple[list[CollectiveOp], Collectives]:
    """Every collective that moves data, with its runs per executed step, and their totals per kind
    with the module docstring's notes."""
    done_types = async_done_types(module)
    users = users_of(i for body in module.computations.values() for i in body)
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
    walk = Walk(module, collective, inside_loop)
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


def collective_stats(module: Module) -> dict[str, Any]:
    """Per kind, `{"count", "bytes", "operand_bytes"}` per device per executed step: result and
    input bytes, summed over tuple elements; absent kinds are left out."""
    return collective_ops(module)[1].to_json()
