"""A GPU trace's kernels joined to their HLO instructions where the trace's `hlo_op` does not
name one. XLA:GPU (jax 0.11) runs most of a step as command buffers (CUDA graphs; kernel by
kernel while profiling), and CUPTI then gives each kernel of a graph the command buffer's thunk
as its `hlo_op` (`command_buffer_188`), an instruction no HLO text has. The kernel's own name
still tells its instruction for the kernels XLA emits (a fusion `loop_add_fusion.12` launches
`loop_add_fusion_12`: the name with every character a symbol cannot hold as `_`); a library's
kernel (cuBLAS's `nvjet_…`, the driver's `memcpy…` and `Memset`, a Triton custom call's
`t5_attention_…`) has none, and is joined by its place: a graph's kernels run in its thunks'
order, close to the schedule's, so one between two named kernels belongs to the library call
of its class (GEMM, attention, copy) that lies between their instructions, or else to the
nearest one (the graph runs independent kernels in an order of its own). A `Memset` or
(cuBLAS's, 4 bytes) is the call's after it; a `memcpy…` no copy instruction explains (a
loop's counter) keeps no instruction.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Callable, Sequence

from t5scale.analysis.hlo_module import Module

_SYMBOL = re.compile(r"[^A-Za-z0-9_]")
_HELPER = re.compile(r"Memset")  # what cuBLAS launches before its GEMM, in the same thunk
_COPY_SUFFIX = re.compile(r"__\d+$")  # a Triton kernel's name where two calls share it


@dataclasses.dataclass(frozen=True)
class Place:
    """An instruction's place in the schedule: its computation and index there."""

    computation: str
    index: int


def kernel_symbol(instruction: str) -> str:
    """The name XLA:GPU gives the kernel of an instruction it emits."""
    return _SYMBOL.sub("_", instruction)


def join_kernels(
    events: Sequence, module: Module, classes: dict[str, str], name_class: Callable[[str], str]
) -> list[str | None]:
    """Each event's instruction (None where none is found), events of one lane in time order:
    its `hlo_op` where the program has it, else its name's instruction, else by its place
    (module docstring). `classes` are the launching instructions' classes."""
    places = {i.name: Place(c, n) for c, body in module.computations.items()
              for n, i in enumerate(body)}  # fmt: skip
    by_symbol = {kernel_symbol(name): name for name in places}
    named = [_named(e, module, by_symbol) for e in events]
    traced = {name for name in named if name}
    library = {name for name in classes if name not in traced}
    # each computation's library calls, (index, name) in schedule order: the joins below look
    # only at these, not at every instruction (an unrolled step's entry has tens of thousands)
    calls_in: dict[str, list[tuple[int, str]]] = {}
    for name in library:
        place = places[name]
        calls_in.setdefault(place.computation, []).append((place.index, name))
    for listed in calls_in.values():
        listed.sort()
    joined = list(named)
    anchors = [n for n, name in enumerate(named) if name]
    bounds = [-1, *anchors, len(events)]
    for before, after in zip(bounds, bounds[1:], strict=False):
        if after - before <= 1:
            continue
        run = range(before + 1, after)
        start = places[named[before]] if before >= 0 else None
        end = places[named[after]] if after < len(events) else None
        calls = _calls_between(start, end, calls_in)
        between = set(calls)
        calls += [c for c in _calls_near(start, end, calls_in) if c not in between]
        kernels = [events[n].name for n in run]
        for n, call in zip(run, _match(kernels, calls, classes, module, name_class), strict=True):
            joined[n] = call
    return joined


def _named(event, module: Module, by_symbol: dict[str, str]) -> str | None:
    if event.hlo_op in module.by_name:
        return event.hlo_op
    return event.name if event.name in module.by_name else by_symbol.get(event.name)


def _calls_between(
    start: Place | None, end: Place | None, calls_in: dict[str, list[tuple[int, str]]]
) -> list[str]:
    """The library calls after `start` and before `end` in the schedule: between them in one
    computation, else after `start` in its computation and before `end` in its own (a loop's
    body ending, or entered). `calls_in`: each computation's calls, in schedule order."""
    if start and end and start.computation == end.computation and start.index < end.index:
        spans = [(start.computation, start.index + 1, end.index)]
    else:
        spans = [(p.computation, p.index + 1, None) for p in (start,) if p]
        spans += [(p.computation, 0, p.index) for p in (end,) if p]
    found = []
    for computation, first, last in spans:
        listed = calls_in.get(computation, [])
        low = bisect.bisect_left(listed, (first, ""))
        high = len(listed) if last is None else bisect.bisect_left(listed, (last, ""))
        found += [name for _, name in listed[low:high]]
    return found


def _calls_near(
    start: Place | None, end: Place | None, calls_in: dict[str, list[tuple[int, str]]]
) -> list[str]:
    """The library calls of the two kernels' computations, nearest to them first: a graph
    runs independent kernels in an order of its own, not always the schedule's."""
    near: dict[str, int] = {}
    for place in (p for p in (start, end) if p):
        for index, name in calls_in.get(place.computation, []):
            distance = abs(index - place.index)
            near[name] = min(distance, near.get(name, distance))
    return sorted(near, key=near.__getitem__)


def _match(
    kernels: list[str], calls: list[str], classes: dict[str, str], module: Module, name_class
) -> list[str | None]:
    """Each kernel's call: the first call left of its class, one whose metadata names the
    kernel where one does (a graph may run independent kernels out of the schedule's order);
    a memset, the call of the library kernel after it."""
    matched: list[str | None] = [None] * len(kernels)
    left = list(calls)
    for n, kernel in enumerate(kernels):
        if _HELPER.match(kernel):
            continue
        kind = name_class(kernel)
        fits = [c for c in left if classes[c] == kind]
        named = f"/{_COPY_SUFFIX.sub('', kernel)}/"
        call = next((c for c in fits if named in module.by_name[c].attributes), None)
        if call or fits:
            matched[n] = call or fits[0]
            left.remove(matched[n])
    for n in reversed(range(len(kernels) - 1)):
        if _HELPER.match(kernels[n]):
            matched[n] = matched[n + 1]
    return matched
