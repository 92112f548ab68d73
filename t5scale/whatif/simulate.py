"""`t5scale simulate`: seconds per step on a described GPU cluster or TPU pod, from the
compiled step.

    t5scale simulate --gin_file=gin/models/mt5_xxl.gin --gin_file=gin/clusters/a100.gin
    t5scale simulate --gin_file=gin/models/mt5_xxl.gin --gin_file=gin/precision/mixed.gin \
        --gin_file=gin/clusters/tpu_v5p.gin --gin.TpuPodConfig.slice="'v5p-128'" \
        --gin.SimulateConfig.nodes="(1, 2)"

On a TPU pod `nodes` counts slices of the pod's slice, each step is compiled by XLA:TPU for
their chips and timed by t5scale/whatif/tpu_step.py (unvalidated: no published T5 step time on
TPUs was found to check it against).

For each ZeRO stage and node count the train step is compiled on as many emulated CPU devices
as the cluster has GPUs (zero over all of them, or over all but `tensor`) — and, for each H in
`diloco_every`, DiLoCo's inner and outer steps with a replica per node and zero inside it
(t5scale/train/replicas.py) — and the cluster model
(t5scale/whatif/) times what the compiled step does: its collectives, each placed on the
nodes by its replica group, its compute, its update, and what hides behind what. Compiled
analyses are cached on disk, so a second run over the same grid compiles nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from t5scale.analysis.records import StepAnalysis
from t5scale.errors import ConfigError, check_field_types
from t5scale.parallel.mesh import make_mesh
from t5scale.parallel.zero import check_stages, with_pipeline
from t5scale.target import Target
from t5scale.train.config import RunConfig
from t5scale.train.replicas import ReplicaSyncConfig
from t5scale.whatif.compile import Compiler, DoesNotFit, analysis_or_refusal, cluster_target
from t5scale.whatif.gpu_step import ProgramTime
from t5scale.whatif.hardware import ClusterConfig
from t5scale.whatif.step_time import (
    StepTimePrediction,
    predict,
    predict_from_program,
    prediction_of,
)
from t5scale.whatif.tpu_pod import TpuPodConfig
from t5scale.whatif.tpu_step import UNVALIDATED, predict_tpu_program
from t5scale.whatif.weak_scaling import weak_scale
from t5scale.xla_gpu import COMBINE_THRESHOLD_BYTES
from t5scale.xla_tpu import TpuTopology


@dataclasses.dataclass(frozen=True)
class SimulateConfig:
    nodes: tuple[int, ...] = (1, 2, 4, 8)
    stages: tuple[int, ...] = (1, 2, 3)
    micro_batch_size: int = 4  # per data-parallel rank; global batch grows with the GPUs
    tensor: int = 1  # tensor parallelism inside each node
    # Pipeline degrees (t5scale/train/pipeline.py), each with the stages it allows (0, 1); the
    # stages span nodes first. micro_batches: per step (default: the run's MICRO_BATCHES), each
    # of micro_batch_size sequences per data-parallel rank; a pipeline needs a multiple of it.
    pipelines: tuple[int, ...] = (1,)
    micro_batches: int | None = None
    overlap: bool = True  # communication hides behind compute where the structure allows
    # XLA's GPU combine thresholds, as launch/xla_gpu_flags.sh sets them
    combine_threshold_bytes: int = COMBINE_THRESHOLD_BYTES
    # DiLoCo beside the synchronous stages: a replica per node, an outer step every H steps for
    # each H here (ReplicaSyncConfig's other settings, e.g. outer_dtype, as gin binds them)
    diloco_every: tuple[int, ...] = ()
    # Which compiler makes the programs the model times: 'gpu', XLA's GPU compiler for the
    # cluster's own GPUs (its compile_target; needs jax's CUDA plugin, t5scale/xla_gpu.py);
    # 'cpu', emulated CPU devices; 'auto', the GPU compiler where the plugin is installed.
    compiler: Compiler = "auto"

    def __post_init__(self) -> None:
        check_field_types(self)
        object.__setattr__(self, "nodes", tuple(self.nodes))  # gin gives lists
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "diloco_every", tuple(self.diloco_every))
        object.__setattr__(self, "pipelines", tuple(self.pipelines))
        if not self.pipelines or min(self.pipelines) < 1:
            raise ConfigError(f"SimulateConfig.pipelines must be >= 1, got {self.pipelines}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ConfigError(
                f"SimulateConfig.micro_batches must be >= 1, got {self.micro_batches}"
            )
        if any(every < 1 for every in self.diloco_every):
            raise ConfigError("SimulateConfig.diloco_every: each H must be >= 1")
        if min((*self.nodes, self.micro_batch_size, self.tensor, self.combine_threshold_bytes),
               default=0) < 1 or not self.nodes:  # fmt: skip
            raise ConfigError("SimulateConfig: nodes, micro_batch_size, tensor and "
                              "combine_threshold_bytes must be >= 1")  # fmt: skip
        check_stages(self.stages, "SimulateConfig.stages")
        if not self.stages:
            raise ConfigError("SimulateConfig.stages is empty")


@dataclasses.dataclass(frozen=True)
class SimulatedRow:
    """One stage, synchronisation and node count: the step's shape and its predicted time."""

    stage: int
    sync: str  # in words: 'every step', 'DiLoCo H=4'
    nodes: int
    devices: int
    analysis: StepAnalysis
    prediction: StepTimePrediction
    timed: ProgramTime | None = None  # the TPU path's parts, overlap from the schedule

    @property
    def pipeline(self) -> int:
        return self.analysis.pipeline

    def to_json(self) -> dict[str, Any]:
        analysis = self.analysis
        return {
            "stage": self.stage,
            "pipeline": self.pipeline,
            "tensor": self.analysis.tensor,
            "micro_batches": self.analysis.micro_batches,
            "sync": self.sync,
            "nodes": self.nodes,
            "devices": self.devices,
            "batch_size": analysis.batch_size,
            "precision": analysis.precision.mode,
            "zero_formula": analysis.model_state_per_device.zero_formula,
            "remat": analysis.remat.policy,  # 'auto': what the step chose on this many devices
        } | self.prediction.to_json()


@dataclasses.dataclass(frozen=True)
class RefusedPoint:
    """A point of the grid whose program the compiler refused for memory: it does not fit."""

    stage: int
    sync: str
    nodes: int
    devices: int
    pipeline: int
    refusal: DoesNotFit

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "sync": self.sync, "pipeline": self.pipeline,
            "nodes": self.nodes, "devices": self.devices, "fits": False,
            "compiler_said": self.refusal.said,
        }  # fmt: skip

    def line(self, cells: Sequence[object], pipelined: bool) -> str:
        """Its row in a table: `stage`, the `cells` after it, then `fits`."""
        first = f"| {self.pipeline} (–) " if pipelined else ""
        middle = "".join(f" {cell} |" for cell in cells)
        return f"{first}| {self.stage} |{middle} no: {self.refusal.words} |"


@dataclasses.dataclass(frozen=True)
class Simulation:
    """`t5scale simulate`'s rows for one model on one cluster."""

    run: RunConfig
    cluster: ClusterConfig | TpuPodConfig
    config: SimulateConfig
    rows: tuple[SimulatedRow, ...]
    # 'gpu': the programs XLA:GPU compiled for the cluster, timed kernel by kernel; 'cpu': the
    # CPU compiler's, with XLA:GPU's combining and overlap assumed (whatif/step_time.py);
    # 'tpu': XLA:TPU's for a pod's slices (whatif/tpu_step.py)
    path: str = "cpu"
    refused: tuple[RefusedPoint, ...] = ()  # points XLA refused for memory: they do not fit

    def to_json(self) -> dict[str, Any]:
        """`t5scale simulate --json`."""
        run = self.run
        return {
            "model": run.model.name,
            "path": self.path,
            "compiler": self.rows[0].analysis.compiler if self.rows else None,
            "cluster": dataclasses.asdict(self.cluster),
            "micro_batch_size": self.config.micro_batch_size,
            "tensor": self.config.tensor,
            "overlap": self.config.overlap,
            "lengths": [run.data.input_length, run.data.target_length],
            "dtype": run.model.dtype,
            "precision": self.rows[0].analysis.precision.mode if self.rows else None,
            "remat": run.model.remat,
            "rows": [row.to_json() for row in self.rows],
            "refused": [point.to_json() for point in self.refused],
        }


def simulate(
    run: RunConfig, cluster: ClusterConfig | TpuPodConfig, config: SimulateConfig, show=print
) -> Simulation:
    if isinstance(cluster, TpuPodConfig):
        return simulate_tpu_pod(run, cluster, config, show)
    if cluster.gpus_per_node % config.tensor:  # tensor groups live inside a node
        raise ConfigError(f"SimulateConfig.tensor={config.tensor} must divide "
                          f"ClusterConfig.gpus_per_node={cluster.gpus_per_node}")  # fmt: skip
    # the largest first: a ConfigError before any compile where it cannot be had
    largest = cluster_target(cluster, max(config.nodes) * cluster.gpus_per_node, config.compiler)
    gpu = largest.is_gpu
    syncs = [(ReplicaSyncConfig(), "every step")] + [
        (dataclasses.replace(run.sync, mode="diloco", every=every), f"DiLoCo H={every}")
        for every in config.diloco_every
    ]
    grid = [
        (stage, pipeline, nodes, sync)
        for pipeline in config.pipelines for stage in _stages(config, pipeline)
        for sync in (syncs if pipeline == 1 else syncs[:1]) for nodes in config.nodes
    ]  # fmt: skip
    rows, refused = [], []
    for done, (stage, pipeline, nodes, (sync, sync_name)) in enumerate(grid, 1):
        devices = nodes * cluster.gpus_per_node
        target = cluster_target(cluster, devices, "gpu" if gpu else "cpu")
        staged = weak_scale(
            dataclasses.replace(run, sync=sync), stage, devices, config.micro_batch_size,
            micro_batches=config.micro_batches, tensor=config.tensor,
            replicas=nodes if sync.local else 1, hosts=target.dcn_granules, pipeline=pipeline,
        )  # fmt: skip
        budget = int(cluster.device_memory_gb * 1e9)
        piped = f"pipeline {pipeline}, " if pipeline > 1 else ""
        point = f"{piped}stage {stage}, {sync_name}, {nodes} node{'s' if nodes > 1 else ''}"
        analysis = analysis_or_refusal(staged, target, budget, point)
        if isinstance(analysis, DoesNotFit):
            refused.append(RefusedPoint(stage, sync_name, nodes, devices, pipeline, analysis))
            show(f"[{done}/{len(grid)}] {point}: does not fit ({analysis.words})")
            continue
        prediction = _predict(analysis, run, cluster, config, gpu)
        rows.append(SimulatedRow(stage, sync_name, nodes, devices, analysis, prediction))
        show(f"[{done}/{len(grid)}] {point}: {prediction.step_s:.3f} s/step predicted")
    path = "gpu" if gpu else "cpu"
    return Simulation(run, cluster, config, tuple(rows), path, tuple(refused))


def _stages(config: SimulateConfig, pipeline: int) -> tuple[int, ...]:
    """The stages of `config` that `pipeline` stages allow (0 and 1 with a pipeline)."""
    return with_pipeline(config.stages, pipeline)


def _predict(
    analysis: StepAnalysis, run: RunConfig, cluster: ClusterConfig, config: SimulateConfig,
    gpu: bool,
) -> StepTimePrediction:  # fmt: skip
    # remat 'auto': what the compiled step chose on this many devices
    model = dataclasses.replace(run.model, remat=analysis.remat.policy)
    if gpu:
        return predict_from_program(analysis, model, cluster, overlap=config.overlap)
    return predict(analysis, model, cluster, config.overlap, config.combine_threshold_bytes)


def simulate_tpu_pod(
    run: RunConfig, pod: TpuPodConfig, config: SimulateConfig, show=print
) -> Simulation:
    """`simulate` on a TPU pod: for each stage and each count in `config.nodes` of the pod's
    slice, the step compiled by XLA:TPU for their chips (zero over every chip of every slice,
    as weak_scale lays one replica) and timed from its program (t5scale/whatif/tpu_step.py).
    A point XLA:TPU refuses for memory is reported as not fitting (`Simulation.refused`)."""
    if config.diloco_every:
        raise ConfigError("SimulateConfig.diloco_every: simulate times DiLoCo on GPU clusters "
                          "only so far")  # fmt: skip
    if run.model.dtype != "bfloat16":
        raise ConfigError("simulate on a TPU pod times bf16 compute (ModelConfig.dtype="
                          "'bfloat16'; the chips' peak is bf16's)")  # fmt: skip
    one = pod.topology().slice  # a ConfigError before any compile where none is chosen
    grid = [
        (stage, pipeline, slices)
        for pipeline in config.pipelines for stage in _stages(config, pipeline)
        for slices in config.nodes
    ]  # fmt: skip
    rows, refused = [], []
    for done, (stage, pipeline, slices) in enumerate(grid, 1):
        topology = TpuTopology(one, slices)
        target = Target.compile_only_tpus(topology)
        staged = weak_scale(run, stage, target.size, config.micro_batch_size,
                            micro_batches=config.micro_batches, tensor=config.tensor,
                            hosts=target.dcn_granules, pipeline=pipeline)  # fmt: skip
        piped = f"pipeline {pipeline}, " if pipeline > 1 else ""
        point = f"{piped}stage {stage}, {slices} × {one.name}"
        budget = int(pod.device_memory_gb * 1e9)
        analysis = analysis_or_refusal(staged, target, budget, point)
        if isinstance(analysis, DoesNotFit):
            refused.append(RefusedPoint(stage, "every step", slices, target.size, pipeline,
                                        analysis))  # fmt: skip
            show(f"[{done}/{len(grid)}] {point}: does not fit ({analysis.words})")
            continue
        devices = list(make_mesh(staged.parallel, list(target.devices)).devices.flat)
        timed = predict_tpu_program(analysis.program, pod, topology, devices)
        prediction = _tpu_prediction(analysis, pod, timed, config.overlap)
        rows.append(SimulatedRow(stage, "every step", slices, target.size, analysis, prediction,
                                 timed))  # fmt: skip
        show(f"[{done}/{len(grid)}] {point}: {prediction.step_s:.3f} s/step predicted "
             "(unvalidated)")  # fmt: skip
    return Simulation(run, pod, config, tuple(rows), "tpu", tuple(refused))


def _tpu_prediction(
    analysis: StepAnalysis, pod: TpuPodConfig, timed: ProgramTime, overlap: bool
) -> StepTimePrediction:
    exposed = timed.exposed_communication_s if overlap else timed.communication_s
    return prediction_of(
        analysis, pod.peak_flops, pod.device_memory_gb, timed.compute_s, timed.communication_s,
        exposed, timed.communication_by_kind_s,
    )  # fmt: skip


def with_overlap(result: Simulation, overlap: bool) -> Simulation:
    """The same compiled steps predicted with or without overlap (the bound), compiling nothing."""
    config = dataclasses.replace(result.config, overlap=overlap)
    gpu = result.path == "gpu"

    def again(row: SimulatedRow) -> StepTimePrediction:
        if row.timed is not None:
            return _tpu_prediction(row.analysis, result.cluster, row.timed, overlap)
        return _predict(row.analysis, result.run, result.cluster, config, gpu)

    rows = tuple(dataclasses.replace(row, prediction=again(row)) for row in result.rows)
    return dataclasses.replace(result, config=config, rows=rows)


def _pipeline_cell(row: SimulatedRow, pipelined: bool) -> str:
    """A table's first cell where some rows are pipelined: stages (micro-batches a step)."""
    return f"| {row.pipeline} ({row.analysis.micro_batches}) " if pipelined else ""


def _pipeline_header(rows: Sequence[SimulatedRow]) -> tuple[str, str]:
    """(header cell, rule cell) where some of `rows` are pipelined, else empty."""
    if any(row.pipeline > 1 for row in rows):
        return "| pipeline (micro-batches) ", "|---"
    return "", ""


def _row_line(row: SimulatedRow, pipelined: bool = False) -> str:
    """The row of format_simulation's table."""
    predicted = row.prediction
    outer = (
        f"{predicted.outer_step_s:.3f} ({predicted.outer_step_s / predicted.sync_every:.4f})"
        if predicted.sync_every else "–"
    )  # fmt: skip
    return (
        f"{_pipeline_cell(row, pipelined)}"
        f"| {row.stage} | {row.sync} | {row.analysis.model_state_per_device.zero_formula} | "
        f"{row.nodes} | {row.devices} | "
        f"{predicted.step_s:.3f} | {predicted.compute_s:.3f} | {predicted.update_s:.3f} | "
        f"{predicted.communication_s:.3f} ({predicted.exposed_communication_s:.3f}) | {outer} | "
        f"{predicted.tokens_per_s:,.0f} | {predicted.tokens_per_s_per_device:,.0f} | "
        f"{100 * predicted.mfu:.0f}% | {'yes' if predicted.fits else 'no'} "
        f"({predicted.xla_peak_bytes / 1e9:.0f}) |"
    )


PATHS = {
    "tpu": UNVALIDATED + " Each step as XLA's TPU compiler made it for the pod's chips (no TPU "
    "here), its collectives over the slices' ICI tori and between slices over DCN, overlap "
    "from its schedule.",
    "gpu": "GPU path: each step as XLA's GPU compiler made it for the cluster's GPUs (no GPU "
    "here), timed kernel by kernel, its collectives as XLA combined them, overlap from its "
    "schedule.",
    "cpu": "CPU path: each step as XLA's CPU compiler made it for emulated devices; XLA:GPU's "
    "combining and overlap assumed (for the GPU path: the `gpu-compile` extra).",
}


def format_simulation(result: Simulation) -> str:
    cluster, config, run = result.cluster, result.config, result.run
    precision = result.rows[0].analysis.precision.mode if result.rows else None
    if result.path == "tpu":
        return _format_tpu_simulation(result)
    header, rule = _pipeline_header(result.rows)
    lines = [
        PATHS[result.path],
        "",
        f"{run.model.name} on {cluster.name} nodes ({cluster.gpus_per_node} GPUs each; "
        f"{cluster.peak_flops / 1e12:g} TFLOP/s peak, GEMMs at "
        f"{cluster.gemm_efficiency:.0%}; bus bandwidth NVLink "
        f"{cluster.nvlink_bus_bandwidth / 1e9:g} GB/s, network "
        f"{cluster.network_bus_bandwidth / 1e9:g} GB/s per node; overlap "
        f"{'from the step' if config.overlap else 'off'}); micro-batch "
        f"{config.micro_batch_size} per GPU, tensor {config.tensor}, lengths "
        f"{run.data.input_length}/{run.data.target_length}, {run.model.dtype} compute, "
        f"{precision} precision, remat {run.model.remat}",
        "",
        header
        + "| stage | replicas sync | ZeRO formula | nodes | GPUs | step s | compute s | update s | "
        "communication s (exposed) | outer step s (per step) | tokens/s | tokens/s/GPU | MFU | "
        "fits (XLA GB) |",
        rule + "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_row_line(row, bool(header)) for row in result.rows),
        *(
            point.line([point.sync, "–", point.nodes, point.devices, *"–" * 8], bool(header))
            for point in result.refused
        ),
    ]
    return "\n".join(lines)


def _format_tpu_simulation(result: Simulation) -> str:
    pod, config, run = result.cluster, result.config, result.run
    header, rule = _pipeline_header(result.rows)
    precision = result.rows[0].analysis.precision.mode if result.rows else None
    lines = [
        PATHS["tpu"],
        "",
        f"{run.model.name} on {pod.name} ({pod.slice}; {pod.peak_flops / 1e12:g} TFLOP/s bf16 "
        f"and {pod.memory_bandwidth / 1e9:g} GB/s of HBM a chip; ICI "
        f"{pod.ici_link_bandwidth / 1e9:g} GB/s a link one way; DCN "
        f"{pod.dcn_bandwidth_per_host / 1e9:g} GB/s a host; overlap "
        f"{'from the step' if config.overlap else 'off'}); micro-batch "
        f"{config.micro_batch_size} per chip, tensor {config.tensor}, lengths "
        f"{run.data.input_length}/{run.data.target_length}, {precision} precision, remat "
        f"{run.model.remat}",
        "",
        header + "| stage | ZeRO formula | slices | chips | step s | compute s | communication s "
        "(exposed) | tokens/s | tokens/s/chip | MFU | fits (XLA GB) |",
        rule + "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result.rows:
        predicted = row.prediction
        lines.append(
            f"{_pipeline_cell(row, bool(header))}| {row.stage} | {row.analysis.model_state_per_device.zero_formula} | {row.nodes} | "
            f"{row.devices} | {predicted.step_s:.3f} | {predicted.compute_s:.3f} | "
            f"{predicted.communication_s:.3f} ({predicted.exposed_communication_s:.3f}) | "
            f"{predicted.tokens_per_s:,.0f} | {predicted.tokens_per_s_per_device:,.0f} | "
            f"{100 * predicted.mfu:.0f}% | {'yes' if predicted.fits else 'no'} "
            f"({predicted.xla_peak_bytes / 1e9:.0f}) |"
        )
    lines.extend(point.line(["–", point.nodes, point.devices, *"–" * 6], bool(header))
                 for point in result.refused)  # fmt: skip
    return "\n".join(lines)
