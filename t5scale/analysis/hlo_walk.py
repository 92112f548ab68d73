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
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

from t5scale.analysis.hlo_module import NAME_PATTERN, Instruction, Module, operand_name

Item = TypeVar("Item")  # what a walk counts: collectives, kernels

_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=" + NAME_PATTERN
)
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_BODY = re.compile(r"\bbody=" + NAME_PATTERN)
_FUSED = re.compile(r"\bcalls=" + NAME_PATTERN)
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


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
        callees += re.findall(NAME_PATTERN, listed)
    return callees


def trip_count(instruction: Instruction, module: Module | None = None) -> int | None:
    """Iterations of a `while`, from XLA's `known_trip_count` backend config (XLA:CPU and
    XLA:GPU write it), else, given its module, from the loop itself where it counts `i` from a
    constant up to a constant by 1 (XLA:TPU writes no such config)."""
    found = _TRIP_COUNT.search(instruction.attributes)
    if found:
        return int(found.group(1))
    return None if module is None else _counted_trips(instruction, module)


def _counted_trips(loop: Instruction, module: Module) -> int | None:
    """c to n by 1: the condition's root is `get-tuple-element(state, k) < constant n`, the
    initial state's element k a constant c (maybe copied), the body's element k that element
    plus constant 1; None for any other loop."""
    condition, body = (re.search(rf"\b{role}=" + NAME_PATTERN, loop.attributes)
                       for role in ("condition", "body"))  # fmt: skip
    if not (condition and body and loop.operands):
        return None
    computations, by_name = module.computations, module.by_name
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


def calls(instruction: Instruction, module: Module | None = None) -> list[Call]:
    """The computations an instruction runs, per run of it (module docstring); without its
    module, a `while` without XLA's trip count is taken for one of unknown trip count."""
    trips = trip_count(instruction, module) if instruction.opcode == "while" else None
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


def fused_body(instruction: Instruction, module: Module) -> Sequence[Instruction]:
    """The instructions of the computation a fusion runs (`calls=`); none if it names none."""
    name = fused_name(instruction)
    return module.computations.get(name, []) if name else []


def fused_parameter(body: Sequence[Instruction], position: int) -> Instruction | None:
    """The parameter of a fused computation that the fusion's operand at `position` becomes."""
    return next(
        (i for i in body if i.opcode == "parameter" and i.operands[:1] == (str(position),)), None
    )


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
        module: Module,
        find: Callable[[Instruction, str], Counter[Item] | None],
        in_loop: Callable[[Item, Loop], Item] = _unmarked,
    ):
        self.module = module
        self.find, self.in_loop = find, in_loop
        self.unknown_loops: set[str] = set()  # names of the `while`s of unknown trip count met
        self._per_run: dict[str, Counter[Item]] = {}

    def per_run(self, computation: str) -> Counter[Item]:
        """What one run of `computation` holds, loops counted relative to it."""
        if computation not in self._per_run:
            self._per_run[computation] = Counter()  # HLO has no recursion: guards bad input only
            total: Counter[Item] = Counter()
            for instruction in self.module.computations.get(computation, []):
                total.update(self.of_instruction(instruction, computation))
            self._per_run[computation] = total
        return self._per_run[computation]

    def of_instruction(self, instruction: Instruction, computation: str) -> Counter[Item]:
        """What one run of an instruction of `computation` is, or runs."""
        found = self.find(instruction, computation)
        return found if found is not None else self.called(instruction)

    def called(self, instruction: Instruction) -> Counter[Item]:
        """What the computations an instruction runs hold, per run of the instruction."""
        if instruction.opcode == "while" and trip_count(instruction, self.module) is None:
            self.unknown_loops.add(instruction.name)
        total: Counter[Item] = Counter()
        for call in calls(instruction, self.module):
            for item, count in self.per_run(call.computation).items():
                if call.loop is not None:
                    item = self.in_loop(item, call.loop)
                total[item] += call.runs * count
        return total
