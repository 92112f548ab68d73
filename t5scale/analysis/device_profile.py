"""A profiled step's time on the device, by kernel class: the trace jax.profiler writes
(`create_perfetto_trace`: XLA's trace-viewer JSON, gzipped) joined to the program that ran.

- kernels: on a GPU, every event on the device's streams (CUPTI's lines, `Stream #…`); XLA:GPU
  annotates each kernel with its program (`hlo_module`) and an `hlo_op`: its HLO instruction
  outside command buffers (CUDA graphs), but inside one the command buffer's thunk
  (`command_buffer_188`), which no HLO text has: those are joined by their name and place
  (kernel_join.py). Without a GPU device in the trace, XLA:CPU's operations: the host threads' events that
  carry an `hlo_op`. An event holding others on its lane is left out, its time being theirs,
  and so, on the CPU, is a loop or call whose computations' operations are events of their own
  on any thread (one that ran as one operation, XLA:CPU's small call, is 'other'); events of
  another program are left out too;
- classes: each kernel's instruction as the kernel inventory (t5scale/analysis/kernels.py)
  classes it, its fusions split into reductions (a `reduce` inside) and elementwise; a
  collective instruction is a collective. A kernel whose `hlo_op` the program lacks is classed
  by its own name (`BY_NAME`), and counted as such;
- two cuts across the classes, by the instruction's JAX op_name: the head and loss (what the
  differentiated loss function runs outside the model's scope `MT5`: the output projection,
  log-sum-exp, z-loss and their gradients) and the update after the gradient (what the step
  function runs at its top level, outside any function or module: AdamW, the new bf16 copy);
- per step: totals over the profiled steps, divided by their number; the device's wall is from
  the first kernel's start to the last one's end (steps dispatched back to back), busy is the
  union of the kernels' intervals over all lanes, idle the wall less busy. The classes sum to
  busy plus the time kernels on different lanes ran at once (`concurrent_s`).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from t5scale.analysis.hlo import collective_kind
from t5scale.analysis.hlo_module import Instruction, Module, parse_module
from t5scale.analysis.hlo_walk import called_names, fused_body
from t5scale.analysis.kernel_join import join_kernels, kernel_symbol
from t5scale.analysis.kernels import instruction_kernels

CLASSES = ("gemm", "attention", "elementwise", "reduction", "copy", "collective", "other")
CUTS = ("head_and_loss", "update")

# A kernel's own name where its HLO op is unknown: cuBLAS's (nvjet, xmma, cutlass), cuDNN's
# and t5scale's attention kernels, t5scale's output layer's (a GEMM with the loss's reduction),
# NCCL's, memory moves, XLA's fusions.
BY_NAME = (
    ("attention", re.compile(r"t5_attention|fmha|flash", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|\bdot|t5_head", re.I)),
    ("collective", re.compile(r"nccl|all-reduce|all-gather|reduce-scatter", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|transpose", re.I)),
    ("reduction", re.compile(r"reduc", re.I)),
    ("elementwise", re.compile(r"fusion|elementwise", re.I)),
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MODULE = re.compile(r"^HloModule\s+([\w.\-]+)")
_LOSS = re.compile(r"^jit\([^)]*\)/(?:transpose\()?jvp\(\)")  # the loss function's own ops
_TOP_LEVEL = re.compile(r"^jit\([^)]*\)/[\w\-]+$")  # an op of the step function itself
_REDUCES = ("reduce", "reduce-window")


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One kernel (or XLA:CPU operation) as the trace has it; times in microseconds."""

    name: str
    hlo_op: str | None
    hlo_module: str | None
    lane: tuple[int, int]  # (process, thread): a device's stream, or a host thread
    start_us: float
    duration_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


@dataclasses.dataclass(frozen=True)
class Trace:
    """The kernel events of a trace: `source` 'gpu' (device streams) or 'cpu' (XLA:CPU)."""

    source: str
    kernels: tuple[TraceEvent, ...]


def read_trace(path: Path | str) -> Trace:
    """The kernel events of a trace.json.gz (module docstring)."""
    with gzip.open(path, "rt") as file:
        events = json.load(file)["traceEvents"]
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") in
             ("process_name", "thread_name")}  # fmt: skip
    gpus = {pid for (pid, tid), name in names.items() if tid is None and "/device:GPU" in name}

    def on_stream(event) -> bool:
        return names.get((event.get("pid"), event.get("tid")), "").startswith("Stream")

    if gpus:
        chosen = [e for e in events if e.get("pid") in gpus and on_stream(e)]
    else:
        chosen = [e for e in events if "hlo_op" in e.get("args", {})]
    kernels = tuple(_event(e) for e in chosen if e.get("ph") == "X")
    return Trace("gpu" if gpus else "cpu", kernels)


def _event(event: dict) -> TraceEvent:
    args = event.get("args", {})
    return TraceEvent(
        name=event.get("name", ""),
        hlo_op=args.get("hlo_op") or None,
        hlo_module=args.get("hlo_module") or None,
        lane=(event.get("pid", 0), event.get("tid", 0)),
        start_us=float(event["ts"]),
        duration_us=float(event.get("dur", 0.0)),
    )


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Seconds per step on the device by class (CLASSES) and cut (CUTS), and what was read."""

    steps: int
    seconds: dict[str, float]
    kernels: dict[str, float]  # launches per step, by class
    cuts: dict[str, float]  # seconds per step of the head and loss, and of the update
    busy_s: float
    wall_s: float
    by_name: int  # kernel events classed by their own name, all steps
    by_place: int  # GPU kernel events joined to their instruction by their place, all steps
    containers: int  # events left out for holding others (XLA:CPU's loops), all steps
    other_programs: int  # events of another program, left out
    uneven_ops: tuple[str, ...]  # HLO ops whose kernel count the steps do not divide

    @property
    def idle_s(self) -> float:
        return self.wall_s - self.busy_s

    @property
    def concurrent_s(self) -> float:
        """Kernel time counted twice by the classes: kernels on different lanes at once."""
        return sum(self.seconds.values()) - self.busy_s


def device_profile(trace: Trace, program: str | Module, steps: int) -> DeviceProfile:
    """`steps` profiled steps of `program` (its HLO text, or parsed), per step (module
    docstring)."""
    module = parse_module(program) if isinstance(program, str) else program
    ours, kept, classes, by_place = _read(trace, module)
    cuts = instruction_cuts(module)
    micros, launches, cut_us = Counter(), Counter(), Counter()
    by_name = 0
    for event in kept:
        kind = classes.get(event.hlo_op or "")
        if kind is None:
            kind, by_name = name_class(event.name), by_name + 1
        micros[kind] += event.duration_us
        launches[kind] += 1
        if (cut := cuts.get(event.hlo_op or "")) and kind != "collective":
            cut_us[cut] += event.duration_us
    counts = Counter(e.hlo_op for e in kept if e.hlo_op)
    return DeviceProfile(
        steps=steps,
        seconds={kind: micros[kind] * 1e-6 / steps for kind in CLASSES},
        kernels={kind: launches[kind] / steps for kind in CLASSES},
        cuts={cut: cut_us[cut] * 1e-6 / steps for cut in CUTS},
        busy_s=_union_us(kept) * 1e-6 / steps,
        wall_s=_wall_us(kept) * 1e-6 / steps,
        by_name=by_name,
        by_place=by_place,
        containers=len(ours) - len(kept),
        other_programs=len(trace.kernels) - len(ours),
        uneven_ops=tuple(sorted(op for op, n in counts.items() if n % steps)),
    )


def program_kernels(trace: Trace, module: Module) -> tuple[list[TraceEvent], dict[str, str]]:
    """The program's kernels that the classes count, each with `hlo_op` its instruction where
    one is found, and the instructions' classes (CLASSES)."""
    _, kept, classes, _ = _read(trace, module)
    return kept, classes


def _read(
    trace: Trace, module: Module
) -> tuple[list[TraceEvent], list[TraceEvent], dict[str, str], int]:
    """The program's events, those kept (not containers), the classes, and how many were
    joined by their place."""
    program = _program_name(module, trace)
    ours = [e for e in trace.kernels if e.hlo_module in (None, program)]
    classes = instruction_classes(module)
    by_place = 0
    if trace.source == "gpu":
        ours, by_place = _joined(ours, module, classes)
    containers = _containers(ours)
    if trace.source == "cpu":
        held = _held_elsewhere(ours, module, classes)
        containers |= {e for e in ours if e.hlo_op in held}
        classes |= {e.hlo_op: "other" for e in ours if e.hlo_op in module.by_name
                    and e.hlo_op not in classes and e.hlo_op not in held}  # fmt: skip
    return ours, [e for e in ours if e not in containers], classes, by_place


def _joined(
    events: Sequence[TraceEvent], module: Module, classes: dict[str, str]
) -> tuple[list[TraceEvent], int]:
    """The events with `hlo_op` their instruction (kernel_join.py), and how many of them
    were joined by their place."""
    joined, by_place = [], 0
    lanes: dict[tuple[int, int], list[TraceEvent]] = {}
    for event in sorted(events, key=lambda e: e.start_us):
        lanes.setdefault(event.lane, []).append(event)
    for lane in lanes.values():
        names = join_kernels(lane, module, classes, name_class)
        for event, name in zip(lane, names, strict=True):
            by_place += name not in (None, event.hlo_op) and kernel_symbol(name) != event.name
            joined.append(dataclasses.replace(event, hlo_op=name or event.hlo_op))
    return joined, by_place


def _program_name(module: Module, trace: Trace) -> str | None:
    """The program's name as its kernels carry it: the HLO module's, or where no kernel
    carries that, the one most of them do (only the step ran while profiling)."""
    named = Counter(e.hlo_module for e in trace.kernels if e.hlo_module)
    found = _MODULE.match(module.header)
    if found and found.group(1) in named or not named:
        return found.group(1) if found else None
    return named.most_common(1)[0][0]


def name_class(kernel: str) -> str:
    """A kernel's class from its own name (BY_NAME), 'other' where nothing matches."""
    return next((kind for kind, pattern in BY_NAME if pattern.search(kernel)), "other")


def instruction_classes(module: Module) -> dict[str, str]:
    """CLASSES of the instructions that launch kernels, by name: the kernel inventory's, its
    fusions split into reductions and elementwise; and the collectives. A kernel named by
    another instruction (a loop's, say) is classed by its own name."""
    kernels = instruction_kernels(module)
    classes = {}
    for body in _unfused(module):
        for instruction in body:
            kernel = kernels.get(instruction.name)
            if kernel is None and collective_kind(instruction.opcode):
                classes[instruction.name] = "collective"
            elif kernel is not None and kernel.kind == "fusion":
                reduces = any(i.opcode in _REDUCES for i in fused_body(instruction, module))
                classes[instruction.name] = "reduction" if reduces else "elementwise"
            elif kernel is not None:
                classes[instruction.name] = kernel.kind
    return classes


def instruction_cuts(module: Module) -> dict[str, str]:
    """CUTS of the instructions that belong to one, by name (module docstring)."""
    cuts = {}
    for body in _unfused(module):
        for instruction in body:
            op_name = _op_name(instruction, module)
            if _LOSS.match(op_name):
                cuts[instruction.name] = "head_and_loss"
            elif _TOP_LEVEL.match(op_name):
                cuts[instruction.name] = "update"
    return cuts


def _op_name(instruction: Instruction, module: Module) -> str:
    """The instruction's op_name, or, for a fusion without one, its fused root's."""
    if found := _OP_NAME.search(instruction.attributes):
        return found.group(1)
    body = fused_body(instruction, module)
    found = _OP_NAME.search(body[-1].attributes) if body else None
    return found.group(1) if found else ""


def _unfused(module: Module) -> list[Sequence[Instruction]]:
    """The computations whose instructions are kernels, collectives and control flow: those the
    entry reaches through calls, loops and branches, not fusions' or reducers'."""
    reached, stack = set(), [module.entry] if module.entry else []
    while stack:
        name = stack.pop()
        if name in reached or name not in module.computations:
            continue
        reached.add(name)
        for instruction in module.computations[name]:
            if instruction.opcode not in ("fusion", "fusion-start"):
                stack.extend(called_names(instruction))
    return [module.computations[name] for name in reached]


def _held_elsewhere(events: Sequence[TraceEvent], module: Module, classes: dict) -> set[str]:
    """XLA:CPU's instructions that launch no kernel and whose computations' operations are
    events of their own, on any thread (a loop's body may run on another than the loop). The
    rest of them ran as one operation (XLA:CPU's small calls): 'other'."""
    traced = {e.hlo_op for e in events}
    held = set()
    for name in traced - classes.keys():
        instruction = module.by_name.get(name)
        callees = called_names(instruction) if instruction else []
        if any(i.name in traced for c in callees for i in module.computations.get(c, [])):
            held.add(name)
    return held


def _containers(events: Sequence[TraceEvent]) -> set[TraceEvent]:
    """Events that wholly hold another event of their lane."""
    holding: set[TraceEvent] = set()
    by_lane: dict[tuple[int, int], list[TraceEvent]] = {}
    for event in events:
        by_lane.setdefault(event.lane, []).append(event)
    for lane in by_lane.values():
        open_events: list[TraceEvent] = []
        for event in sorted(lane, key=lambda e: (e.start_us, -e.duration_us)):
            while open_events and open_events[-1].end_us <= event.start_us:
                open_events.pop()
            holding.update(e for e in open_events if e.end_us >= event.end_us)
            open_events.append(event)
    return holding


def _union_us(events: Sequence[TraceEvent]) -> float:
    total, reached = 0.0, float("-inf")
    for event in sorted(events, key=lambda e: e.start_us):
        if event.end_us > reached:
            total += event.end_us - max(event.start_us, reached)
            reached = event.end_us
    return total


def _wall_us(events: Sequence[TraceEvent]) -> float:
    if not events:
        return 0.0
    return max(e.end_us for e in events) - min(e.start_us for e in events)
