"""Seconds per step on a GPU cluster from the program XLA compiled for it (kernels.py's
Program): the GPU path, where step_time.py's CPU path has to assume what XLA:GPU combines
and overlaps.

- compute: each kernel runs at the slower of its FLOPs at the achieved GEMM rate (peak ×
  gemm_efficiency; the 16-bit peak, or `peak_flops_float32` for f32 operands; fused attention
  at peak × attention_efficiency, as measured on the card) and its bytes
  read and written at the achieved bandwidth (memory_bandwidth × memory_efficiency), plus one
  launch (KERNEL_LAUNCH_S). `fit_factor`, the share of that roofline a compiled step reaches,
  divides the roofline part, not the launches: 1 for the bare roofline, or a figure fitted on
  measured GPU steps;
- communication: each collective as XLA combined it, timed by collectives.py on the nodes its
  replica group spans (device i on node i // gpus_per_node, processes slowest);
- overlap, from the schedule: an asynchronous collective hides behind the kernels scheduled
  between its start and done, up to their time; the rest of it, and every synchronous one, is
  exposed.

step = compute + exposed communication; the optimizer update is among the kernels. Not
modelled: kernels slowed by a collective sharing the GPU's SMs and memory, collectives in
flight at once contending for the links (each hides behind its own window), host gaps beyond
one launch per kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from t5scale.analysis.collectives import CollectiveOp
from t5scale.analysis.kernels import KERNEL_CLASSES, Kernel, Program
from t5scale.jsonform import JsonRecord
from t5scale.whatif.collectives import collective_seconds, full_bytes, placement
from t5scale.whatif.hardware import ClusterConfig

# What one kernel costs beyond its own work. NVIDIA's "Getting Started with CUDA Graphs"
# (developer.nvidia.com/blog/cuda-graphs/) times a 2.9 µs kernel at 3.8 µs per kernel when
# launches queue back to back on one stream, about 1 µs of gap each, and at several times that
# when the host waits on each; XLA:GPU's runtime adds its own host work per thunk. 2 µs sits
# between the queued gap and the host-bound cost; measured steps are to refit it.
KERNEL_LAUNCH_S = 2e-6
_FLOAT32 = ("f32", "f64")


@dataclasses.dataclass(frozen=True)
class ProgramTime(JsonRecord):
    """Seconds of one step of a compiled GPU program on a cluster, and their parts."""

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


def kernel_seconds(
    kernel: Kernel,
    cluster: ClusterConfig,
    fit_factor: float = 1.0,
    launch_s: float = KERNEL_LAUNCH_S,
) -> float:
    """One run of `kernel`: the slower of its FLOPs and its bytes, over `fit_factor`, plus its
    launch."""
    peak = cluster.peak_flops_float32 if kernel.dtype in _FLOAT32 else cluster.peak_flops
    efficiency = (
        cluster.attention_efficiency if kernel.kind == "attention" else cluster.gemm_efficiency
    )
    arithmetic = kernel.flops / (peak * efficiency)
    memory = (kernel.bytes_read + kernel.bytes_written) / (
        cluster.memory_bandwidth * cluster.memory_efficiency
    )
    return max(arithmetic, memory) / fit_factor + launch_s


def collective_run_seconds(op: CollectiveOp, devices: int, cluster: ClusterConfig) -> float:
    """One run of a collective, placed on the nodes by its replica group."""
    where = placement(op.group, devices, cluster.gpus_per_node)
    return collective_seconds(op.kind, full_bytes(op), where, cluster)


def predict_program(
    program: Program,
    cluster: ClusterConfig,
    devices: int | None = None,
    fit_factor: float = 1.0,
    launch_s: float = KERNEL_LAUNCH_S,
) -> ProgramTime:
    """Seconds per step of `program` on `cluster` (module docstring). `devices`: how many the
    program spans, by default as its HLO says."""
    if fit_factor <= 0:
        raise ValueError(f"fit_factor must be > 0, got {fit_factor!r}")
    devices = program.devices if devices is None else devices
    each = [kernel_seconds(kernel, cluster, fit_factor, launch_s) for kernel in program.kernels]
    launches = sum(kernel.runs for kernel in program.kernels)
    return timed_program(
        program, each, lambda op: collective_run_seconds(op, devices, cluster), launches * launch_s
    )


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
