"""Seconds per step on a GPU cluster, from a compiled step's analysis (step_analysis.json).

step = compute (compute.py) + optimizer update + the communication left exposed.

What overlaps what is read from the compiled program's structure, assuming what
launch/xla_gpu_flags.sh turns on for GPUs (XLA's latency-hiding scheduler, pipelined
collectives). Each ZeRO collective (its group spans no `tensor`) is placed by the loops around
it, which JAX names in the HLO: the layer scans end in `encoder/while` or `decoder/while`, and
the backward pass's carry `transpose(` in their name.

- `forward` / `backward`: inside a layer loop (stage 3's gather of the next layer's parameters,
  a layer's gradient reduce-scatter): hides behind that pass's layer compute, but for one
  layer's worth (the first gather, the last reduction: fill and drain);
- `gradient`: a reduce-scatter or all-reduce outside the layer loops (the gradients' reduction
  at stages 0–2): the pipeliner moves a stacked gradient's reduction into the backward loop, so
  it hides behind the backward compute that the layer collectives left free, but for one
  layer's worth; one that runs once per step after gradient accumulation (outside the
  micro-batch loop) only behind the last micro-batch's share;
- `exposed`: everything else — collectives over `tensor` (activations the next operation waits
  for), the update's all-gather of new parameters (stages 1–2: nothing is left to hide it
  behind), non-layer gathers, and scalars (≤ 1 KiB: the loss, the gradient norm that clipping
  waits for).

`overlap=False` exposes everything, the other bound.

XLA's GPU combiners merge independent collectives of one kind over one group in one
computation into messages of up to `combine_threshold_bytes` (launch/xla_gpu_flags.sh sets
128 MiB), so stage 3's dozen per-layer gathers pay one launch and one ring's latency, not
twelve. The CPU compiler that made the analysed program does not combine them; the model does,
for ZeRO collectives only (tensor parallelism's all-reduces each wait for the compute before).

Not modelled: compute slowed by communication kernels sharing the GPU, contention between
concurrent collectives.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from t5scale.analysis.flops import mfu
from t5scale.analysis.hlo import mesh_axes
from t5scale.cluster_model.collectives import collective_seconds, full_bytes, placement
from t5scale.cluster_model.compute import step_compute
from t5scale.cluster_model.hardware import ClusterConfig
from t5scale.model.sizes import ModelConfig

DATA_AXES = {"replica", "zero"}
# launch/xla_gpu_flags.sh: --xla_gpu_{all_gather,reduce_scatter,all_reduce}_combine_threshold_bytes
XLA_COMBINE_THRESHOLD_BYTES = 134_217_728


def over_data_axes(op: dict[str, Any], mesh: dict[str, int]) -> bool:
    """Whether a collective is ZeRO's or data parallelism's (its group spans no `tensor`)."""
    return mesh_axes(op["group"], mesh) <= DATA_AXES


def combined(
    ops: list[dict[str, Any]], mesh: dict[str, int], threshold: int
) -> list[dict[str, Any]]:
    """The collectives as XLA's GPU combiners would launch them: the ZeRO collectives of one
    kind, group, computation and loop nest merged, per run of that computation, into as few
    messages of at most `threshold` bytes as their total allows (never more than there were)."""
    merged: dict[tuple, dict[str, Any]] = {}
    result = []
    for op in ops:
        if not op["count"]:
            continue
        if not over_data_axes(op, mesh):
            result.append(op)
            continue
        group = None if op["group"] is None else tuple(op["group"])
        key = (op["kind"], group, op["computation"], tuple(op["loops"]),
               tuple(op.get("loop_names", ())))  # fmt: skip
        into = merged.setdefault(key, {**op, "count": 0, "bytes": 0, "operand_bytes": 0})
        into["count"] += op["count"]
        into["bytes"] += op["count"] * op["bytes"]
        into["operand_bytes"] += op["count"] * op["operand_bytes"]
    for op in merged.values():
        runs = math.prod(op["loops"]) if op["loops"] else 1
        per_run = max(1, op["count"] // runs)  # collectives per run of their computation
        size = full_bytes(op) / runs
        launches = min(per_run, max(1, math.ceil(size / threshold)))
        share = 1 / (runs * launches)  # bytes per launched message
        result.append(op | {"count": runs * launches, "bytes": op["bytes"] * share,
                            "operand_bytes": op["operand_bytes"] * share})  # fmt: skip
    return result


SCALAR_BYTES = 1024  # at most this: a scalar or two (the loss, the gradient norm)
CLASSES = ("forward", "backward", "gradient", "gradient_per_step", "exposed")


def _layer_loop(name: str) -> bool:
    return name.endswith(("encoder/while", "decoder/while"))


def overlap_class(op: dict[str, Any], mesh: dict[str, int]) -> str:
    """One of CLASSES (module docstring)."""
    if not over_data_axes(op, mesh) or full_bytes(op) <= SCALAR_BYTES:
        return "exposed"
    names = op.get("loop_names", [])
    if layer_loops := [name for name in names if _layer_loop(name)]:
        return "backward" if "transpose(" in layer_loops[-1] else "forward"
    if op["kind"] in ("reduce-scatter", "all-reduce"):
        return "gradient" if names else "gradient_per_step"  # inside the micro-batch loop
    return "exposed"


def hidden_seconds(by_class: dict[str, float], compute, depth: int, micro_batches: int) -> float:
    """Communication hidden behind compute: each class behind the compute it may overlap, but
    for one layer's worth (fill and drain)."""
    keep = 1 - 1 / depth
    forward = min(by_class["forward"] * keep, compute.forward_layers)
    backward = min(by_class["backward"] * keep, compute.backward_layers)
    free = compute.backward_layers - backward  # backward compute no layer collective took
    gradient = min(by_class["gradient"] * keep, free)
    last = (free - gradient) / micro_batches  # the last micro-batch's free backward compute
    return forward + backward + gradient + min(by_class["gradient_per_step"] * keep, last)


def owned_parameters(analysis: dict[str, Any]) -> float:
    """Parameters whose update this device runs: its `tensor` slice, and from stage 1 its
    `zero` shard of that."""
    mesh = analysis["mesh"]
    owned = analysis["parameters"] / mesh.get("tensor", 1)
    return owned / mesh["zero"] if analysis["zero_stage"] >= 1 else owned


def update_seconds(analysis: dict[str, Any], cluster: ClusterConfig) -> float:
    """The optimizer update, memory-bound: it reads and writes the optimizer state this device
    owns, reads the owned gradients and reads and writes the owned parameters."""
    mesh, precision = analysis["mesh"], analysis["precision"]
    owned = owned_parameters(analysis)
    optimizer = analysis["model_state_per_device"]["zero_formula_bytes"]["optimizer_state"]
    optimizer /= mesh.get("tensor", 1)
    width = {name: jnp.dtype(precision[name]).itemsize for name in ("gradients", "parameters")}
    per_parameter = width["gradients"] + 2 * width["parameters"]
    moved = 2 * optimizer + owned * per_parameter
    return moved / (cluster.memory_bandwidth * cluster.memory_efficiency)


def outer_step_seconds(
    analysis: dict[str, Any], cluster: ClusterConfig, threshold: int = XLA_COMBINE_THRESHOLD_BYTES
) -> tuple[float, int]:
    """(seconds of one outer step of local SGD or DiLoCo, H); (0, 1) for synchronous steps.

    Its collectives (Δ's all-reduce over `replica`, at stages 1-2 the new parameters' gather)
    are exposed: nothing computes beside them. Its arithmetic is memory-bound: the owned shard
    of the replica's fp32 parameters, the anchor and the momentum read, the last two written,
    and the working copy written."""
    sync = analysis.get("replica_sync", {})
    ops = sync.get("outer_collective_ops")
    if not ops:
        return 0.0, 1
    mesh, devices = analysis["mesh"], analysis["devices"]
    seconds = 0.0
    for op in combined(ops, mesh, threshold):
        where = placement(op["group"], devices, cluster.gpus_per_node)
        seconds += op["count"] * collective_seconds(op["kind"], full_bytes(op), where, cluster)
    owned = owned_parameters(analysis)
    moved = owned * (3 * 4 + 2 * 4 + jnp.dtype(analysis["precision"]["parameters"]).itemsize)
    seconds += moved / (cluster.memory_bandwidth * cluster.memory_efficiency)
    return seconds, sync["every"]


def predict(
    analysis: dict[str, Any],
    model: ModelConfig,
    cluster: ClusterConfig,
    overlap: bool = True,
    combine_threshold_bytes: int = XLA_COMBINE_THRESHOLD_BYTES,
) -> dict[str, Any]:
    """Seconds per step and its parts on `cluster`, for the step `analysis` describes (its mesh
    laid over nodes of `cluster.gpus_per_node` GPUs, processes slowest)."""
    mesh, devices = analysis["mesh"], analysis["devices"]
    sequences = analysis["batch_size"] / (mesh.get("replica", 1) * mesh.get("zero", 1))
    lengths = analysis["lengths"]
    compute = step_compute(model, sequences, *lengths, cluster, tensor=mesh.get("tensor", 1))
    by_class = dict.fromkeys(CLASSES, 0.0)
    by_kind: dict[str, float] = {}
    for op in combined(analysis["collective_ops"], mesh, combine_threshold_bytes):
        where = placement(op["group"], devices, cluster.gpus_per_node)
        seconds = op["count"] * collective_seconds(op["kind"], full_bytes(op), where, cluster)
        by_class[overlap_class(op, mesh)] += seconds
        by_kind[op["kind"]] = by_kind.get(op["kind"], 0.0) + seconds
    communication = sum(by_class.values())
    hidden = 0.0
    if overlap:
        depth = min(analysis["layers"].values())
        hidden = hidden_seconds(by_class, compute, depth, analysis["micro_batches"])
    update = update_seconds(analysis, cluster)
    outer, every = outer_step_seconds(analysis, cluster, combine_threshold_bytes)
    step = compute.total + update + communication - hidden + outer / every
    tokens = analysis["tokens_per_step"]
    peak = cluster.peak_flops_float32 if model.dtype == "float32" else cluster.peak_flops
    return {
        "step_s": step,
        "compute_s": compute.total,
        "update_s": update,
        "communication_s": communication,
        "exposed_communication_s": communication - hidden,
        "communication_by_kind_s": by_kind,
        "communication_by_overlap_s": by_class,
        "hidden_s": hidden,
        "outer_step_s": outer,  # local SGD, DiLoCo: once per `sync_every` steps
        "sync_every": every if analysis.get("replica_sync", {}).get("outer_collective_ops") else 0,
        "sequences_per_s": analysis["batch_size"] / step,
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_device": tokens / step / devices,
        "mfu": mfu(analysis["flops_per_step"]["model"], step, peak, devices),
        "fits": analysis["memory_per_device"]["peak_estimate_bytes"]
        <= cluster.device_memory_gb * 1e9,
        "xla_peak_bytes": analysis["memory_per_device"]["peak_estimate_bytes"],
    }
