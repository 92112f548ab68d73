"""A compiled program's step from the time of each of its operations and collectives: the core
the GPU path (gpu_step.py) and the TPU path (tpu_step.py) share. Each hardware module says what
one kernel and one collective cost; this adds them up and hides each asynchronous collective
behind the operations its schedule places inside its window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.analysis.kernels import KERNEL_CLASSES, Program
from t5scale.jsonform import JsonRecord


@dataclasses.dataclass(frozen=True)
class ProgramTime(JsonRecord):
    """Seconds of one step of a compiled program on its hardware, and their parts."""

    step_s: float  # compute_s + exposed_communication_s
    compute_s: float  # every kernel, launches included
    launch_s: float  # the launches' share of compute_s
    compute_by_class_s: dict[str, float]  # kernels.KERNEL_CLASSES
    communication_s: float  # every collective, as if nothing hid it
    exposed_communication_s: float
    hidden_s: float  # communication_s - exposed_communication_s
    communication_by_kind_s: dict[str, float]
    exposed_by_kind_s: dict[str, float]
    kernels: int  # launches per step


def timed_program(
    program: Program,
    each: Sequence[float],
    run_seconds: Callable[[CollectiveOp], float],
    launch_s: float = 0.0,
) -> ProgramTime:
    """A program's step from one run of each of its kernels (`each`, in program.kernels'
    order) and of each collective (`run_seconds`): all the kernels, every collective, and the
    part of each asynchronous one that the kernels scheduled inside its window hide (GPU and
    TPU paths alike). `launch_s`: the launches' share of the kernels' seconds."""
    by_class = dict.fromkeys(KERNEL_CLASSES, 0.0)
    for kernel, seconds in zip(program.kernels, each, strict=True):
        by_class[kernel.kind] += kernel.runs * seconds
    by_kind: dict[str, float] = {}
    exposed_by_kind: dict[str, float] = {}
    for collective in program.collectives:
        op = collective.op
        run = run_seconds(op)
        hidden = 0.0
        if not collective.synchronous:
            behind = sum(each[index] * count for index, count in collective.overlapped)
            hidden = min(run, behind)
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + op.count * run
        exposed_by_kind[op.kind] = exposed_by_kind.get(op.kind, 0.0) + op.count * (run - hidden)
    compute, communication = sum(by_class.values()), sum(by_kind.values())
    exposed = sum(exposed_by_kind.values())
    return ProgramTime(
        step_s=compute + exposed,
        compute_s=compute,
        launch_s=launch_s,
        compute_by_class_s=by_class,
        communication_s=communication,
        exposed_communication_s=exposed,
        hidden_s=communication - exposed,
        communication_by_kind_s=by_kind,
        exposed_by_kind_s=exposed_by_kind,
        kernels=sum(kernel.runs for kernel in program.kernels),
    )
