"""`t5scale simulate`: seconds per step on a described GPU cluster or TPU pod, from the
compiled step.

    t5scale simulate --gin_file=gin/models/mt5_xxl.gin --gin_file=gin/clusters/a100.gin
    t5scale simulate --gin_file=gin/models/mt5_xxl.gin --gin_file=gin/precision/mixed.gin \
        --gin_file=gin/clusters/tpu_v5p.gin --gin.TpuPodConfig.slice="'v5p-128'" \
        --gin.SimulateConfig.nodes="(1, 2)"

`nodes` counts the groups the slow network joins: a GPU cluster's nodes, or slices of a TPU
pod's slice. For each ZeRO stage and count the train step is compiled for that many of the
hardware's devices (zero over all of them, or over all but `tensor`) by its own compiler (XLA:GPU
or XLA:TPU, compile-only; emulated CPU devices on a GPU cluster where jax's CUDA plugin is
missing) — and, for each H in `diloco_every`, DiLoCo's inner and outer steps with a replica per
node (t5scale/train/replicas.py) — and the hardware's cost model times its program
(whatif/hardware.py): its operations, its collectives over the links their groups span, and
what hides behind what. The TPU path is unvalidated (no published TPU step time of T5 or mT5
was found to check it against). Compiled analyses are cached on disk, so a second run over the
same grid compiles nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from t5scale.analysis.records import StepAnalysis
from t5scale.errors import ConfigError, check_field_types
from t5scale.parallel.mesh import make_mesh
from t5scale.parallel.zero import check_stages, with_pipeline
from t5scale.train.config import RunConfig
from t5scale.train.replicas import ReplicaSyncConfig
from t5scale.whatif.compile import Compiler, DoesNotFit, analysis_or_refusal
from t5scale.whatif.hardware import Hardware
from t5scale.whatif.program_time import ProgramTime
from t5scale.whatif.step_time import StepTimePrediction
from t5scale.whatif.tpu_step import UNVALIDATED
from t5scale.whatif.weak_scaling import weak_scale
from t5scale.xla_gpu import COMBINE_THRESHOLD_BYTES


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
    # cluster's own GPUs (its gpu_target; needs jax's CUDA plugin, t5scale/xla_gpu.py);
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
    # the mesh's devices in order, where each collective's group sits (with_overlap again)
    mesh_devices: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)

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
    """`t5scale simulate`'s rows for one model on one GPU cluster or TPU pod."""

    run: RunConfig
    hardware: Hardware
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
            "cluster": dataclasses.asdict(self.hardware),
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


def simulate(run: RunConfig, hardware: Hardware, config: SimulateConfig, show=print) -> Simulation:
    """Each stage, synchronisation and count of `config.nodes` (the nodes or slices the slow
    network joins) compiled for the hardware and timed from its program; a point the compiler
    refuses for memory is reported as not fitting (`Simulation.refused`)."""
    hardware.check_simulation(run, config)
    # the largest first: a ConfigError before any compile where it cannot be had
    path = hardware.timing_path(hardware.group_target(max(config.nodes), config.compiler))
    syncs = [(ReplicaSyncConfig(), "every step")] + [
        (dataclasses.replace(run.sync, mode="diloco", every=every), f"DiLoCo H={every}")
        for every in config.diloco_every
    ]
    grid = [
        (stage, pipeline, groups, sync)
        for pipeline in config.pipelines for stage in with_pipeline(config.stages, pipeline)
        for sync in (syncs if pipeline == 1 else syncs[:1]) for groups in config.nodes
    ]  # fmt: skip
    rows, refused = [], []
    for done, (stage, pipeline, groups, (sync, sync_name)) in enumerate(grid, 1):
        target = hardware.group_target(groups, config.compiler)
        staged = weak_scale(
            dataclasses.replace(run, sync=sync), stage, target.size, config.micro_batch_size,
            micro_batches=config.micro_batches, tensor=config.tensor,
            replicas=groups if sync.local else 1, dcn_groups=target.dcn_groups, pipeline=pipeline,
        )  # fmt: skip
        piped = f"pipeline {pipeline}, " if pipeline > 1 else ""
        point = f"{piped}stage {stage}, {sync_name}, {hardware.group_words(groups)}"
        analysis = analysis_or_refusal(staged, target, hardware.memory_budget_bytes, point)
        if isinstance(analysis, DoesNotFit):
            refused.append(RefusedPoint(stage, sync_name, groups, target.size, pipeline, analysis))
            show(f"[{done}/{len(grid)}] {point}: does not fit ({analysis.words})")
            continue
        devices = list(make_mesh(staged.parallel, list(target.devices)).devices.flat)
        # remat 'auto': what the compiled step chose on this many devices
        model = dataclasses.replace(run.model, remat=analysis.remat.policy)
        prediction, timed = hardware.predict(analysis, model, devices, config)
        rows.append(SimulatedRow(stage, sync_name, groups, target.size, analysis, prediction,
                                 timed, tuple(devices)))  # fmt: skip
        caveat = " (unvalidated)" if path == "tpu" else ""
        show(f"[{done}/{len(grid)}] {point}: {prediction.step_s:.3f} s/step predicted{caveat}")
    return Simulation(run, hardware, config, tuple(rows), path, tuple(refused))


def with_overlap(result: Simulation, overlap: bool) -> Simulation:
    """The same compiled steps predicted with or without overlap (the bound), compiling nothing."""
    config = dataclasses.replace(result.config, overlap=overlap)

    def again(row: SimulatedRow) -> StepTimePrediction:
        model = dataclasses.replace(result.run.model, remat=row.analysis.remat.policy)
        return result.hardware.predict(row.analysis, model, row.mesh_devices, config)[0]

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
    hardware, config, run = result.hardware, result.config, result.run
    precision = result.rows[0].analysis.precision.mode if result.rows else None
    header, rule = _pipeline_header(result.rows)
    groups, devices = f"{hardware.group_word}s", f"{hardware.device_word}s"
    lines = [
        PATHS[result.path],
        "",
        f"{run.model.name} on {hardware.describe(config)}, tensor {config.tensor}, lengths "
        f"{run.data.input_length}/{run.data.target_length}, {run.model.dtype} compute, "
        f"{precision} precision, remat {run.model.remat}",
        "",
        header
        + f"| stage | replicas sync | ZeRO formula | {groups} | {devices} | step s | compute s | "
        "update s | communication s (exposed) | outer step s (per step) | tokens/s | "
        f"tokens/s/{hardware.device_word} | MFU | fits (XLA GB) |",
        rule + "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_row_line(row, bool(header)) for row in result.rows),
        *(
            point.line([point.sync, "–", point.nodes, point.devices, *"–" * 8], bool(header))
            for point in result.refused
        ),
    ]
    return "\n".join(lines)
