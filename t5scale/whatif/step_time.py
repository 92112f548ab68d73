"""Seconds per step on a GPU cluster, from a compiled step's analysis (step_analysis.json): the CPU
path, which assumes what launch/xla_gpu_flags.sh makes XLA:GPU combine and overlap
(docs/cluster_model.md, "Overlap, from the program's structure").

step = compute (compute.py) + optimizer update + the communication left exposed.

Each ZeRO collective (its group spans no `tensor`) is placed by the loops around it, which JAX names
in the HLO (the layer scans end in `encoder/while` or `decoder/while`, the backward pass's carry
`transpose(`), into one of CLASSES:

- `forward` / `backward`: inside a layer loop; hides behind that pass's layer compute, but for one
  layer's worth (fill and drain);
- `gradient`: a reduce-scatter or all-reduce outside the layer loops; hides behind the backward
  compute the layer collectives left free, but for one layer's worth; one that runs once per step
  after gradient accumulation only behind the last micro-batch's share;
- `exposed`: everything else — collectives over `tensor`, the update's all-gather at stages 1–2,
  non-layer gathers, and scalars (≤ 1 KiB: the loss, the gradient norm that clipping waits for).

XLA's GPU combiners merge ZeRO collectives of one kind, group and computation into messages of up to
`combine_threshold_bytes` (128 MiB in launch/xla_gpu_flags.sh); the CPU compiler that made the
analysed program does not, so the model does (tensor parallelism's all-reduces each wait for the
compute before).

Not modelled: compute slowed by communication kernels sharing the GPU, contention between concurrent
collectives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.analysis.flops import mfu
from t5scale.analysis.hlo import mesh_axes
from t5scale.analysis.records import StepAnalysis
from t5scale.jsonform import JsonRecord
from t5scale.model.sizes import ModelConfig
from t5scale.whatif.compute import ComputeTime, step_compute
from t5scale.whatif.figures import GpuFigures
from t5scale.whatif.gpu_step import predict_program
from t5scale.whatif.nccl import collective_seconds, full_bytes, placement
from t5scale.xla_gpu import COMBINE_THRESHOLD_BYTES

DATA_AXES = {"replica", "zero"}


def over_data_axes(op: CollectiveOp, mesh: dict[str, int]) -> bool:
    """Whether a collective is ZeRO's or data parallelism's (its group spans no `tensor`)."""
    return mesh_axes(op.group, mesh) <= DATA_AXES


def combined(
    ops: Sequence[CollectiveOp], mesh: dict[str, int], threshold: int
) -> list[CollectiveOp]:
    """The collectives as XLA's GPU combiners would launch them: the ZeRO collectives of one
    kind, group, computation and loop nest merged, per run of that computation, into as few
    messages of at most `threshold` bytes as their total allows (never more than there were)."""
    merged: dict[tuple, CollectiveOp] = {}
    result = []
    for op in ops:
        if not op.count:
            continue
        if not over_data_axes(op, mesh):
            result.append(op)
            continue
        key = (op.kind, op.group, op.computation, op.loops, op.loop_names)
        into = merged.get(key, dataclasses.replace(op, count=0, bytes=0, operand_bytes=0))
        merged[key] = dataclasses.replace(
            into,
            count=into.count + op.count,
            bytes=into.bytes + op.count * op.bytes,  # all of them, until split below
            operand_bytes=into.operand_bytes + op.count * op.operand_bytes,
        )
    for op in merged.values():
        runs = math.prod(op.loops) if op.loops else 1
        per_run = max(1, op.count // runs)  # collectives per run of their computation
        size = full_bytes(op) / runs
        launches = min(per_run, max(1, math.ceil(size / threshold)))
        share = 1 / (runs * launches)  # bytes per launched message
        result.append(dataclasses.replace(
            op, count=runs * launches, bytes=op.bytes * share,
            operand_bytes=op.operand_bytes * share,
        ))  # fmt: skip
    return result


SCALAR_BYTES = 1024  # at most this: a scalar or two (the loss, the gradient norm)
CLASSES = ("forward", "backward", "gradient", "gradient_per_step", "exposed")


def _layer_loop(name: str) -> bool:
    return name.endswith(("encoder/while", "decoder/while"))


def overlap_class(op: CollectiveOp, mesh: dict[str, int]) -> str:
    """One of CLASSES (module docstring)."""
    if not over_data_axes(op, mesh) or full_bytes(op) <= SCALAR_BYTES:
        return "exposed"
    if layer_loops := [name for name in op.loop_names if _layer_loop(name)]:
        return "backward" if "transpose(" in layer_loops[-1] else "forward"
    if op.kind in ("reduce-scatter", "all-reduce"):
        return "gradient" if op.loop_names else "gradient_per_step"  # inside the micro-batch loop
    return "exposed"


@dataclasses.dataclass(frozen=True)
class OverlapSeconds:
    """A step's communication seconds by what compute each class may hide behind (CLASSES)."""

    forward: float = 0.0
    backward: float = 0.0
    gradient: float = 0.0
    gradient_per_step: float = 0.0
    exposed: float = 0.0


def hidden_seconds(
    by_class: OverlapSeconds, compute: ComputeTime, depth: int, micro_batches: int
) -> float:
    """Communication hidden behind compute: each class behind the compute it may overlap, but
    for one layer's worth (fill and drain)."""
    keep = 1 - 1 / depth
    forward = min(by_class.forward * keep, compute.forward_layers)
    backward = min(by_class.backward * keep, compute.backward_layers)
    free = compute.backward_layers - backward  # backward compute no layer collective took
    gradient = min(by_class.gradient * keep, free)
    last = (free - gradient) / micro_batches  # the last micro-batch's free backward compute
    return forward + backward + gradient + min(by_class.gradient_per_step * keep, last)


def owned_parameters(analysis: StepAnalysis) -> float:
    """Parameters whose update this device runs: its `tensor` slice, and from stage 1 its
    `zero` shard of that."""
    owned = analysis.parameters / analysis.tensor
    return owned / analysis.zero if analysis.zero_stage >= 1 else owned


def _memory_seconds(moved: float, cluster: GpuFigures) -> float:
    """Memory-bound work: bytes moved at the achieved memory bandwidth."""
    return moved / (cluster.memory_bandwidth * cluster.memory_efficiency)


def update_seconds(analysis: StepAnalysis, cluster: GpuFigures) -> float:
    """The optimizer update, memory-bound: it reads and writes the optimizer state this device
    owns, reads the owned gradients and reads and writes the owned parameters."""
    precision = analysis.precision
    owned = owned_parameters(analysis)
    state = analysis.model_state_per_device.zero_formula_bytes
    optimizer = state.optimizer_state / analysis.tensor
    gradients = jnp.dtype(precision.gradients).itemsize
    per_parameter = gradients + 2 * jnp.dtype(precision.parameters).itemsize
    return _memory_seconds(2 * optimizer + owned * per_parameter, cluster)


def communication_seconds(
    ops: Sequence[CollectiveOp], analysis: StepAnalysis, cluster: GpuFigures, threshold: int
) -> list[tuple[CollectiveOp, float]]:
    """Each collective as XLA's combiners launch it (`combined`), with its seconds per step on
    `cluster` (all its runs), placed on the nodes by its replica group."""
    timed = []
    for op in combined(ops, analysis.mesh, threshold):
        where = placement(op.group, analysis.devices, cluster.gpus_per_node)
        timed.append((op, op.count * collective_seconds(op.kind, full_bytes(op), where, cluster)))
    return timed


def outer_step_seconds(
    analysis: StepAnalysis, cluster: GpuFigures, threshold: int = COMBINE_THRESHOLD_BYTES
) -> tuple[float, int]:
    """(seconds of one outer step of local SGD or DiLoCo, H); (0, 1) for synchronous steps.

    Its collectives (Δ's all-reduce over `replica`, at stages 1-2 the new parameters' gather)
    are exposed: nothing computes beside them. Its arithmetic is memory-bound: the owned shard
    of the replica's fp32 parameters, the anchor and the momentum read, the last two written,
    and the working copy written."""
    sync = analysis.replica_sync
    if not sync.outer_collective_ops:
        return 0.0, 1
    timed = communication_seconds(sync.outer_collective_ops, analysis, cluster, threshold)
    seconds = sum(spent for _, spent in timed)
    width = jnp.dtype(analysis.precision.parameters).itemsize
    seconds += _memory_seconds(owned_parameters(analysis) * (3 * 4 + 2 * 4 + width), cluster)
    return seconds, sync.every


@dataclasses.dataclass(frozen=True)
class StepTimePrediction(JsonRecord):
    """Seconds per step on a cluster and its parts, with the throughput and MFU they give."""

    step_s: float
    compute_s: float
    update_s: float
    communication_s: float
    exposed_communication_s: float
    communication_by_kind_s: dict[str, float]
    communication_by_overlap_s: dict[str, float]  # CLASSES
    hidden_s: float
    outer_step_s: float  # local SGD, DiLoCo: once per `sync_every` steps
    sync_every: int  # 0 for synchronous steps
    sequences_per_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float
    fits: bool  # XLA's per-device peak within the cluster's device memory
    xla_peak_bytes: int


def predict(
    analysis: StepAnalysis,
    model: ModelConfig,
    cluster: GpuFigures,
    overlap: bool = True,
    combine_threshold_bytes: int = COMBINE_THRESHOLD_BYTES,
) -> StepTimePrediction:
    """Seconds per step and its parts on `cluster`, for the step `analysis` describes (its mesh
    laid over nodes of `cluster.gpus_per_node` GPUs, processes slowest)."""
    sequences = analysis.batch_size / analysis.data_parallel
    compute = step_compute(model, sequences, *analysis.lengths, cluster, tensor=analysis.tensor)
    by_class = dict.fromkeys(CLASSES, 0.0)
    by_kind: dict[str, float] = {}
    timed = communication_seconds(
        analysis.collective_ops, analysis, cluster, combine_threshold_bytes
    )
    for op, seconds in timed:
        by_class[overlap_class(op, analysis.mesh)] += seconds
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + seconds
    communication = sum(by_class.values())
    hidden = 0.0
    if overlap:
        depth = analysis.layers.depth
        hidden = hidden_seconds(OverlapSeconds(**by_class), compute, depth, analysis.micro_batches)
    update = update_seconds(analysis, cluster)
    outer, every = outer_step_seconds(analysis, cluster, combine_threshold_bytes)
    return _prediction(
        analysis, model, cluster, compute.total, update, communication, communication - hidden,
        by_kind, by_class, outer, every,
    )  # fmt: skip


def _prediction(
    analysis: StepAnalysis,
    model: ModelConfig,
    cluster: GpuFigures,
    compute: float,
    update: float,
    communication: float,
    exposed: float,
    by_kind: dict[str, float],
    by_overlap: dict[str, float],
    outer: float,
    every: int,
) -> StepTimePrediction:
    peak = cluster.peak_flops_float32 if model.dtype == "float32" else cluster.peak_flops
    return prediction_of(
        analysis, peak, cluster.device_memory_gb, compute, communication, exposed, by_kind,
        update, by_overlap, outer, every,
    )  # fmt: skip


def prediction_of(
    analysis: StepAnalysis,
    peak_flops: float,
    device_memory_gb: float,
    compute: float,
    communication: float,
    exposed: float,
    by_kind: dict[str, float],
    update: float = 0.0,
    by_overlap: dict[str, float] | None = None,
    outer: float = 0.0,
    every: int = 1,
) -> StepTimePrediction:
    """The step's seconds from its parts, with the throughput, MFU (against `peak_flops` per
    device) and fit (XLA's peak within `device_memory_gb`) they give."""
    step = compute + update + exposed + outer / every
    tokens, devices = analysis.tokens_per_step, analysis.devices
    xla_peak = analysis.memory_per_device.peak_estimate_bytes
    if by_overlap is None:
        by_overlap = {"hidden": communication - exposed, "exposed": exposed}
    return StepTimePrediction(
        step_s=step,
        compute_s=compute,
        update_s=update,
        communication_s=communication,
        exposed_communication_s=exposed,
        communication_by_kind_s=by_kind,
        communication_by_overlap_s=by_overlap,
        hidden_s=communication - exposed,
        outer_step_s=outer,
        sync_every=every if analysis.replica_sync.outer_collective_ops else 0,
        sequences_per_s=analysis.batch_size / step,
        tokens_per_s=tokens / step,
        tokens_per_s_per_device=tokens / step / devices,
        mfu=mfu(analysis.flops_per_step.model, step, peak_flops, devices),
        fits=xla_peak <= device_memory_gb * 1e9,
        xla_peak_bytes=xla_peak,
    )


def predict_from_program(
    analysis: StepAnalysis, model: ModelConfig, cluster: GpuFigures, overlap: bool = True
) -> StepTimePrediction:
    """`predict`'s record from the GPU path: the step XLA:GPU compiled for the cluster
    (analysis.program) timed kernel by kernel (gpu_step.py), its collectives as XLA
    combined them and its overlap from the schedule. The update is among the kernels, so
    update_s is 0; the outer step of local SGD or DiLoCo is timed as in `predict`.
    `overlap=False` exposes every collective (the bound).

    No figure is fitted: the bare roofline of each kernel plus its launch predicted t5scale's
    three one-H100 steps of 2026-11-23 within 3% (docs/cluster_model.md), so the fraction of
    the roofline the CPU path fits (ClusterConfig.roofline_fraction) is not applied here."""
    if analysis.program is None:
        raise ValueError("the GPU path needs a program compiled for GPUs (analysis.program)")
    timed = predict_program(analysis.program, cluster, analysis.devices)
    communication = timed.communication_s
    exposed = timed.exposed_communication_s if overlap else communication
    outer, every = outer_step_seconds(analysis, cluster)
    by_overlap = {"hidden": communication - exposed, "exposed": exposed}
    return _prediction(
        analysis, model, cluster, timed.compute_s, 0.0, communication, exposed,
        timed.communication_by_kind_s, by_overlap, outer, every,
    )  # fmt: skip
