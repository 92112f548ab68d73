"""The call graph of a compiled program: which computations each instruction runs, how often per
run of it, and inside which `while` loops: what counting anything per executed step needs.

t5scale/analysis/hlo.py counts collectives and t5scale/analysis/kernels.py kernels through the
same `Walk`. Each says what one instruction is (a collective, a kernel: its `find`); the walk adds
up, per run of a computation, what its instructions are and, for an instruction that is nothing
of the kind, what the computations it runs hold, times how often it runs them:

- a `call`, an `async-start`, a fusion: its computation once;
- a `conditional`: every branch once, as if each ran (an upper bound);
- a `while` of known trip count n (XLA's `known_trip_count`, or, where XLA:TPU writes none, a
  loop that counts from a constant to a constant by 1): its body n times, each item found
  there marked as inside the loop (`Loop`: n and the loop's op_name), and its condition never:
  XLA's runtimes, on GPUs and on CPUs, run such a loop as n runs of the body and do not evaluate
  the condition at all (their WhileThunk; tests/test_hlo_walk.py sees it on the CPU);
- a `while` of unknown trip count: its body and its condition once each, and the loop is noted.

Reducers (the `to_apply` of a reduce, a sort or a collective) and the `-done` and `-update`
halves of async pairs (which name their start's computation again) are not walked.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:  # hlo.py imports this module, so this one needs nothing of it at run time
    from t5scale.analysis.hlo import Instruction

Item = TypeVar("Item")  # what a walk counts: collectives, kernels

_NAME = r"%?([\w.\-]+)"  # a computation's name, as hlo.NAME_PATTERN (not imported: see above)
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=" + _NAME
)
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_BODY = re.compile(r"\bbody=" + _NAME)
_FUSED = re.compile(r"\bcalls=" + _NAME)
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMMENT = re.compile(r"/\*.*?\*/")


@dataclasses.dataclass(frozen=True)
class Loop:
    """A `while` loop of known trip count, as what runs in its body records it."""

    trips: int
    name: str  # its op_name (JAX's trace path, `…/encoder/while`); "" if it has none


@dataclasses.dataclass(frozen=True)
class Call:
    """A computation an instruction runs and how often per run of the instruction; `loop` is
    set when it is the body of a `while` of known trip count."""

    computation: str
    runs: int
    loop: Loop | None = None


def called_names(instruction: Instruction) -> list[str]:
    """Computations this instruction runs, other than reducers (`to_apply` of a collective)."""
    if instruction.opcode.endswith(("-done", "-update")):
        return []  # async halves repeat the `calls=` of their start
    callees = [
        name
        for role, name in _CALLEE.findall(instruction.attributes)
        # to_apply names the called body only for `call`; elsewhere it is a reducer (add).
        if role != "to_apply" or instruction.opcode == "call"
    ]
    for listed in _CALLEE_LIST.findall(instruction.attributes):
        callees += re.findall(_NAME, listed)
    return callees


def operand_name(operand: str) -> str:
    """An operand's instruction name; long operand lists carry /*index=N*/ comments."""
    return _COMMENT.sub("", operand).split()[-1].lstrip("%")


def trip_count(
    instruction: Instruction,
    computations: Mapping[str, Sequence[Instruction]] | None = None,
    by_name: Mapping[str, Instruction] | None = None,
) -> int | None:
    """Iterations of a `while`, from XLA's `known_trip_count` backend config (XLA:CPU and
    XLA:GPU write it), else, given the module's computations, from the loop itself where it
    counts `i` from a constant up to a constant by 1 (XLA:TPU writes no such config)."""
    found = _TRIP_COUNT.search(instruction.attributes)
    if found:
        return int(found.group(1))
    if not computations:
        return None
    return _counted_trips(instruction, computations, by_name or _names(computations))


def _counted_trips(
    loop: Instruction,
    computations: Mapping[str, Sequence[Instruction]],
    by_name: Mapping[str, Instruction],
) -> int | None:
    """c to n by 1: the condition's root is `get-tuple-element(state, k) < constant n`, the
    initial state's element k a constant c (maybe copied), the body's element k that element
    plus constant 1; None for any other loop."""
    condition, body = (re.search(rf"\b{role}=" + _NAME, loop.attributes)
                       for role in ("condition", "body"))  # fmt: skip
    if not (condition and body and loop.operands):
        return None
    test = computations.get(condition.group(1), [None])[-1]  # the root is printed last
    if test is None or test.opcode != "compare" or "direction=LT" not in test.attributes:
        return None
    counter, bound = (_source(operand, by_name) for operand in test.operands)
    index, limit = _element_index(counter), _constant(bound)
    start = _tuple_element(_source(loop.operands[0], by_name), index, by_name)
    step = _tuple_element(computations.get(body.group(1), [None])[-1], index, by_name)
    if limit is None or (first := _constant(start)) is None or step is None:
        return None
    if step.opcode != "add" or sorted(
        (_element_index(_source(o, by_name)) == index, _constant(_source(o, by_name)) == 1)
        for o in step.operands
    ) != [(False, True), (True, False)]:
        return None
    return max(limit - first, 0)


def _names(computations: Mapping[str, Sequence[Instruction]]) -> dict[str, Instruction]:
    return {i.name: i for body in computations.values() for i in body}


def _source(operand: str | None, by_name: Mapping[str, Instruction]) -> Instruction | None:
    """The instruction an operand names, through copies and bitcasts."""
    if operand is None:
        return None
    value = by_name.get(operand_name(operand))
    while value is not None and value.opcode in ("copy", "bitcast") and value.operands:
        value = by_name.get(operand_name(value.operands[0]))
    return value


def _element_index(value: Instruction | None) -> int | None:
    if value is None or value.opcode != "get-tuple-element":
        return None
    found = re.search(r"\bindex=(\d+)", value.attributes)
    return int(found.group(1)) if found else None


def _constant(value: Instruction | None) -> int | None:
    if value is None or value.opcode != "constant" or len(value.operands) != 1:
        return None
    try:
        return int(value.operands[0])
    except ValueError:
        return None


def _tuple_element(
    value: Instruction | None, index: int | None, by_name: Mapping[str, Instruction]
) -> Instruction | None:
    if value is None or index is None or value.opcode != "tuple" or index >= len(value.operands):
        return None
    return _source(value.operands[index], by_name)


def calls(
    instruction: Instruction,
    computations: Mapping[str, Sequence[Instruction]] | None = None,
    by_name: Mapping[str, Instruction] | None = None,
) -> list[Call]:
    """The computations an instruction runs, per run of it (module docstring)."""
    trips = (
        trip_count(instruction, computations, by_name) if instruction.opcode == "while" else None
    )
    if trips is None:
        return [Call(callee, 1) for callee in called_names(instruction)]
    # Only the body: a loop of known trip count never evaluates its condition (module docstring).
    body = _BODY.search(instruction.attributes)
    name = found.group(1) if (found := _OP_NAME.search(instruction.attributes)) else ""
    return [Call(body.group(1), trips, Loop(trips, name))] if body else []


def fused_name(instruction: Instruction) -> str | None:
    """The computation a fusion runs (`calls=`), if it names one."""
    found = _FUSED.search(instruction.attributes)
    return found.group(1) if found else None


def fused_body(
    instruction: Instruction, computations: Mapping[str, Sequence[Instruction]]
) -> Sequence[Instruction]:
    """The instructions of the computation a fusion runs (`calls=`); none if it names none."""
    name = fused_name(instruction)
    return computations.get(name, []) if name else []


def _unmarked(item: Item, loop: Loop) -> Item:
    return item


class Walk(Generic[Item]):
    """What one run of each computation holds, counted through the call graph (module
    docstring), each computation walked once.

    `find(instruction, computation)` is the user's own logic: what one run of the instruction
    is (a Counter, empty for nothing, and then its callees are not walked), or None to count
    what the computations it runs hold instead. `in_loop(item, loop)` marks an item found in a
    loop's body (by default it stays as it is)."""

    def __init__(
        self,
        computations: Mapping[str, Sequence[Instruction]],
        find: Callable[[Instruction, str], Counter[Item] | None],
        in_loop: Callable[[Item, Loop], Item] = _unmarked,
    ):
        self.computations = computations
        self.find, self.in_loop = find, in_loop
        self.unknown_loops: set[str] = set()  # names of the `while`s of unknown trip count met
        self._per_run: dict[str, Counter[Item]] = {}

    @functools.cached_property
    def by_name(self) -> dict[str, Instruction]:
        """Every instruction by name: to follow a loop's counter to its constants."""
        return _names(self.computations)

    def per_run(self, computation: str) -> Counter[Item]:
        """What one run of `computation` holds, loops counted relative to it."""
        if computation not in self._per_run:
            self._per_run[computation] = Counter()  # HLO has no recursion: guards bad input only
            total: Counter[Item] = Counter()
            for instruction in self.computations.get(computation, []):
                total.update(self.of_instruction(instruction, computation))
            self._per_run[computation] = total
        return self._per_run[computation]

    def of_instruction(self, instruction: Instruction, computation: str) -> Counter[Item]:
        """What one run of an instruction of `computation` is, or runs."""
        found = self.find(instruction, computation)
        return found if found is not None else self.called(instruction)

    def called(self, instruction: Instruction) -> Counter[Item]:
        """What the computations an instruction runs hold, per run of the instruction."""
        # Only a `while` without XLA's trip count needs the names (XLA:TPU's).
        known = (self.computations, self.by_name) if instruction.opcode == "while" else ()
        if instruction.opcode == "while" and trip_count(instruction, *known) is None:
            self.unknown_loops.add(instruction.name)
        total: Counter[Item] = Counter()
        for call in calls(instruction, *known):
            for item, count in self.per_run(call.computation).items():
                if call.loop is not None:
                    item = self.in_loop(item, call.loop)
                total[item] += call.runs * count
        return total
