"""Collectives of a compiled program, counted and sized from its HLO text, per executed step.

A collective inside a `while` loop (the layer scan, the micro-batch loop) appears once in the text
but runs trip-count times; counts and bytes here are multiplied out through the call graph.
Collectives over groups of one device (size-1 mesh axes) move nothing and are left out.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
    "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([^\s(]+)\s*\(.*->.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*")
_CALLEE = re.compile(r"\b(body|condition|calls|true_computation|false_computation)=%([^\s,}]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")


def shape_bytes(type_text: str) -> int:
    """Bytes of an HLO type such as `f32[8,64]{1,0}` or a tuple of them."""
    total = 0
    for dtype, dims in _SHAPE.findall(type_text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _parse_instruction(line: str):
    """(name, result type, opcode, operand names, attributes) of one instruction line."""
    match = _NAME.match(line)
    if not match:
        return None
    rest = line[match.end() :]
    if rest.startswith("("):
        end = _balanced(rest, 0)
        result_type, rest = rest[:end], rest[end:].lstrip()
    else:
        result_type, _, rest = rest.partition(" ")
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode, end = rest[:paren], _balanced(rest, paren)
    operands = re.findall(r"%([^\s,)]+)", rest[paren:end])
    return match.group(1), result_type, opcode, operands, rest[end:]


def _group_size(attributes: str) -> int | None:
    if found := _GROUPS_LIST.search(attributes):
        return len([d for d in found.group(1).split(",") if d])
    if found := _GROUPS_IOTA.search(attributes):
        return int(found.group(1).split(",")[-1])
    return None  # no groups listed: all devices take part


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


def collective_stats(hlo_text: str) -> dict:
    """Per collective kind: {"count", "bytes" (results), "operand_bytes"} per device per step."""
    computations: dict[str, list] = {}
    types: dict[str, str] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if header := _COMPUTATION.match(line):
            current = computations.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
        elif current is not None and (parsed := _parse_instruction(line)):
            current.append(parsed)
            types[parsed[0]] = parsed[1]

    stats: dict = defaultdict(lambda: {"count": 0, "bytes": 0, "operand_bytes": 0})
    unknown_loops = 0

    def visit(name: str, times: int) -> None:
        nonlocal unknown_loops
        for _, result_type, opcode, operands, attributes in computations.get(name, []):
            kind = _kind(opcode)
            if kind and _group_size(attributes) != 1 and "source_target_pairs={}" not in attributes:
                operand_bytes = sum(shape_bytes(types.get(o, "")) for o in operands)
                result_bytes = shape_bytes(result_type)
                if opcode.endswith("-start") and result_type.startswith("("):
                    result_bytes -= operand_bytes  # async tuples hold (operands, results)
                entry_stats = stats[kind]
                entry_stats["count"] += times
                entry_stats["bytes"] += times * result_bytes
                entry_stats["operand_bytes"] += times * operand_bytes
            trips = 1
            if opcode == "while":
                found = _TRIP_COUNT.search(attributes)
                trips = int(found.group(1)) if found else 1
                unknown_loops += 0 if found else 1
            callees = [c for role, c in _CALLEE.findall(attributes) if role != "to_apply"]
            for branches in _BRANCHES.findall(attributes):
                callees += re.findall(r"%([^\s,}]+)", branches)
            for callee in callees:
                visit(callee, times * trips)

    if entry is not None:
        visit(entry, 1)
    result = {kind: dict(stats[kind]) for kind in KINDS if kind in stats}
    if unknown_loops:
        result["unknown_trip_count_loops"] = unknown_loops
    return result


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def collective_summary(stats: dict) -> str:
    """One line, e.g. `all-gather 24× 1.50 MiB, reduce-scatter 12× 0.80 MiB`."""
    parts = [f"{k} {v['count']}× {_mib(v['bytes'])}" for k, v in stats.items() if k in KINDS]
    return ", ".join(parts) or "none"
