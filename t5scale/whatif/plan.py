"""The planner: per ZeRO stage, what a model needs per device on N devices, without a step.

    t5scale plan --gin_file=gin/models/mt5_xxl.gin --gin.DEVICES=64 --gin.DEVICE_MEMORY_GB=80

    t5scale plan --gin_file=gin/models/mt5_xxl.gin --gin_file=gin/clusters/h100.gin \
        --gin.DEVICES=64

For each stage it compiles the train step (nothing is allocated) and gives parameters per
device, model-state bytes per device by the ZeRO formula, XLA's compiled per-device memory
(argument, temp, peak), whether that fits the device memory, and the bytes each collective
moves per step. Without a cluster file it compiles for N emulated CPU devices: XLA's CPU
compiler fuses and schedules differently from an accelerator's, so its temp bytes are an
estimate (the model-state bytes are exact). With a cluster file (whatif/hardware.py), its own
compiler makes the program for N of its devices: XLA:GPU for a GPU cluster that names its
GPU's compile target (t5scale/xla_gpu.py), XLA:TPU for a TPU pod's slices (t5scale/xla_tpu.py,
with each stage's collectives timed over ICI and DCN and the bytes it hands DCN). The memory
is then that program's, and its kernels or operations per step come with it.

    t5scale plan --gin_file=gin/models/mt5_xl.gin --gin_file=gin/clusters/tpu_v5e.gin \
        --gin.TpuPodConfig.slice="'v5e-64'" --gin.TpuPodConfig.slices=2
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from t5scale.analysis.collective_ops import format_bytes
from t5scale.analysis.memory import (
    DcnBytes,
    dcn_formula_bytes,
    dcn_program_bytes,
    zero3_collective_bytes,
)
from t5scale.analysis.records import StatePrecision, StepAnalysis
from t5scale.errors import ConfigError, check_field_types
from t5scale.parallel.vocab import pays_off
from t5scale.parallel.zero import check_stages, with_pipeline
from t5scale.target import Target
from t5scale.train.config import RunConfig
from t5scale.train.setup import Setup
from t5scale.whatif.compile import compile_for
from t5scale.whatif.hardware import Hardware
from t5scale.whatif.weak_scaling import weak_scale

GIB = 2**30
KERNEL_COLUMNS = ("gemm", "fusion", "copy", "attention", "collective")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """devices: the mesh to plan for (zero = devices / tensor, replica 1); the batch is
    weak-scaled as in the study (t5scale/whatif/weak_scaling.py), MICRO_BATCHES accumulated."""

    devices: int = 8
    device_memory_gb: float = 80.0
    stages: tuple[int, ...] = (0, 1, 2, 3)
    micro_batch_size: int = 1
    tensor: int = 1
    # Pipeline degrees to plan (t5scale/train/pipeline.py), each with every stage it allows
    # (0 and 1) and MICRO_BATCHES micro-batches a step; None: the run's ParallelConfig.pipeline.
    pipelines: tuple[int, ...] | None = None
    # A job's compile check: the run exactly as its gin files give it (its own stage, mesh,
    # batch and micro-batches) rather than each of `stages` weak-scaled.
    job: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        object.__setattr__(self, "stages", tuple(self.stages))  # gin gives lists
        if self.tensor < 1:  # before the `%` below
            raise ConfigError(f"PlanConfig.tensor must be >= 1, got {self.tensor}")
        if self.devices < 1 or self.devices % self.tensor:
            raise ConfigError(
                f"PlanConfig.devices={self.devices} must be a positive multiple of "
                f"tensor={self.tensor}"
            )
        if self.device_memory_gb <= 0 or self.micro_batch_size < 1:
            raise ConfigError("PlanConfig.device_memory_gb must be > 0, micro_batch_size >= 1")
        check_stages(self.stages, "PlanConfig.stages")
        if not self.stages:
            raise ConfigError("PlanConfig.stages is empty")
        if self.pipelines is None:
            return
        object.__setattr__(self, "pipelines", tuple(self.pipelines))
        if not self.pipelines or min(self.pipelines) < 1:
            raise ConfigError(f"PlanConfig.pipelines must be >= 1, got {self.pipelines}")
        if any(self.devices % (self.tensor * p) for p in self.pipelines):
            raise ConfigError(
                f"PlanConfig.devices={self.devices} must be a multiple of tensor={self.tensor} "
                f"times each pipeline degree of {self.pipelines}"
            )


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage of the plan: its compiled step's analysis, the parameters one device holds,
    and whether the step fits the device's memory."""

    analysis: StepAnalysis
    parameters_per_device: int
    device_memory_bytes: float
    # On a TPU pod: the program's collectives over the slice's ICI and between slices over DCN,
    # seconds per step with none hidden (t5scale/whatif/ici_dcn.py)
    ici_seconds: float | None = None
    dcn_seconds: float | None = None
    # Between slices: bytes a chip hands DCN per step, read from the program and by the formula
    # (t5scale/analysis/memory.py, dcn_formula_bytes)
    dcn_program: DcnBytes | None = None
    dcn_formula: DcnBytes | None = None

    @property
    def fits(self) -> bool:
        """XLA's per-device peak within the device's memory."""
        return self.analysis.memory_per_device.peak_estimate_bytes <= self.device_memory_bytes

    @property
    def fits_model_state(self) -> bool:
        """The ZeRO formula's model state alone within the device's memory."""
        formula = self.analysis.model_state_per_device.zero_formula_bytes
        return formula.total <= self.device_memory_bytes

    def to_json(self) -> dict[str, Any]:
        analysis = self.analysis
        state = analysis.model_state_per_device
        return {
            "stage": analysis.zero_stage,
            "pipeline": analysis.pipeline,
            "remat": analysis.remat.to_json(),
            "mesh": analysis.mesh,
            "batch_size": analysis.batch_size,
            "parameters": analysis.parameters,
            "precision": analysis.precision.to_json(),
            "parameters_per_device": self.parameters_per_device,
            "zero_formula_bytes": state.zero_formula_bytes.to_json(),
            "zero_formula": state.zero_formula,
            "padded": analysis.padded,
            "xla_memory_per_device": analysis.memory_per_device.to_json(),
            "xla_model_state_per_device": state.to_json(),
            "device_memory_bytes": self.device_memory_bytes,
            "fits": self.fits,
            "fits_model_state": self.fits_model_state,
            "collectives": analysis.collectives.to_json(),
            # XLA:GPU's program per step, loops multiplied out (None from the CPU compiler)
            "kernels": analysis.kernels.to_json() if analysis.kernels else None,
            "flops_per_step": analysis.flops_per_step.to_json(),
            "compile_time_s": analysis.compile_time_s,
            **({"ici_seconds_per_step": self.ici_seconds, "dcn_seconds_per_step": self.dcn_seconds,
                "dcn_bytes_per_step": {"program": self.dcn_program.to_json(),
                                       "formula": self.dcn_formula.to_json()}}
               if self.ici_seconds is not None else {}),
        }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Plan:
    """The plan of one model on `plan.devices` devices, stage by stage (`t5scale plan`)."""

    run: RunConfig
    plan: PlanConfig
    stages: tuple[StagePlan, ...]
    compiler: str  # Target.compiler_name: 'xla:cpu', 'xla:gpu <GPU>, N nodes x G', 'xla:tpu …'
    device_memory_gb: float

    def to_json(self) -> dict[str, Any]:
        """`t5scale plan --json`."""
        run = self.run
        return {
            "model": run.model.name,
            "compiler": self.compiler,
            "devices": self.plan.devices,
            "tensor": self.plan.tensor,
            "device_memory_gb": self.device_memory_gb,
            "dtype": run.model.dtype,
            "precision": self.stages[0].analysis.precision.to_json() if self.stages else None,
            "remat": run.model.remat,
            "optimizer": run.optimizer.name,
            "lengths": [run.data.input_length, run.data.target_length],
            "stages": [stage.to_json() for stage in self.stages],
        }


def plan_stage(
    run: RunConfig,
    plan: PlanConfig,
    stage: int,
    target: Target,
    budget_bytes: float,
    hardware: Hardware | None = None,
    pipeline: int = 1,
) -> StagePlan:
    """The stage compiled with zero over every data-parallel device (replica 1), across the
    nodes or slices too where the target spans several; `pipeline` stages."""
    staged = weak_scale(
        run,
        stage,
        plan.devices,
        plan.micro_batch_size,
        tensor=plan.tensor,
        dcn_groups=target.dcn_groups,
        pipeline=pipeline,
    )
    return compile_stage_plan(staged, target, budget_bytes, hardware)


def compile_stage_plan(
    run: RunConfig, target: Target, budget_bytes: float, hardware: Hardware | None = None
) -> StagePlan:
    """`run` compiled for `target` as it stands (nothing allocated), within `budget_bytes`;
    its collectives timed over the hardware's links where it times them for a plan."""
    step = compile_for(run, target, int(budget_bytes))
    stage = StagePlan(step.analysis, step.setup.layout.parameters_per_device(), budget_bytes)
    devices = list(step.setup.mesh.devices.flat)
    links = hardware.link_seconds(step.analysis.collective_ops, devices) if hardware else None
    if links is None:
        return stage
    return dataclasses.replace(
        stage, ici_seconds=links["ICI"], dcn_seconds=links["DCN"],
        dcn_program=dcn_program_bytes(step.analysis.collective_ops),
        dcn_formula=step_dcn_formula(step.setup, target.dcn_groups),
    )  # fmt: skip


def step_dcn_formula(setup: Setup, slices: int) -> DcnBytes:
    """The DCN formula (dcn_formula_bytes) for a compiled step's run on `slices` slices."""
    run, layout, form = setup.run, setup.layout, setup.form
    across = run.parallel.zero_across_hosts
    chips = layout.zero_size // slices if across else layout.zero_size
    zero3 = None
    if layout.stage.shard_parameters:
        dtype = setup.precision.param_dtype
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), form.canonical.params)
        batch, micro, data = (
            run.train.batch_size // layout.replicas,
            run.train.micro_batches,
            run.data,
        )
        split = layout.vocabulary_parallel and pays_off(
            batch // micro, data.input_length, data.target_length, run.model.vocab_size
        )
        zero3 = zero3_collective_bytes(params, run.model, data, batch, micro, split)
    return dcn_formula_bytes(
        layout.stage, form.model_state_bytes(), chips, slices, run.train.micro_batches, across,
        zero3, steps_alone=run.sync.local,
    )  # fmt: skip


def run_plan(
    run: RunConfig, plan: PlanConfig, show=print, hardware: Hardware | None = None
) -> Plan:
    """Each stage compiled for `plan.devices` emulated CPU devices; with a cluster file's
    hardware, for that many of its devices by its own compiler (a TPU pod's named slices where
    it names them), its device memory the budget."""
    target, budget = _plan_target(plan, hardware)
    plan = dataclasses.replace(plan, devices=target.size)
    show(f"compiling for {target.compiler_name}")
    if plan.job:
        job = compile_stage_plan(run, target, budget, hardware)
        show(f"the job (stage {run.parallel.zero_stage}): compiled in "
             f"{job.analysis.compile_time_s:.1f} s")  # fmt: skip
        return Plan(run, plan, (job,), target.compiler_name, budget / 1e9)
    stages = []
    for pipeline in plan.pipelines or (run.parallel.pipeline,):
        allowed = with_pipeline(plan.stages, pipeline)
        if len(allowed) < len(plan.stages):
            show(f"pipeline {pipeline}: ZeRO stages 0 and 1 only (a pipeline accumulates each "
                 "stage's gradients inside its schedule, as DeepSpeed's refuses 2 and 3)")  # fmt: skip
        for stage in allowed:
            stages.append(plan_stage(run, plan, stage, target, budget, hardware, pipeline))
            where = f"pipeline {pipeline}, " if pipeline > 1 else ""
            show(f"{where}stage {stage}: compiled in {stages[-1].analysis.compile_time_s:.1f} s")
    if not stages:
        raise ConfigError(
            f"nothing to plan: a pipeline takes ZeRO stages 0 and 1, not {plan.stages}"
        )
    return Plan(run, plan, tuple(stages), target.compiler_name, budget / 1e9)


def _plan_target(plan: PlanConfig, hardware: Hardware | None) -> tuple[Target, float]:
    """What to compile for, and the memory budget in bytes."""
    if hardware is None:
        here = Target.local()
        if here.size < plan.devices:
            raise ConfigError(f"{plan.devices} devices to plan for, {here.size} emulated")
        return Target.local(plan.devices), plan.device_memory_gb * 1e9
    named = hardware.named_target()
    if named is not None and plan.devices not in (PlanConfig.devices, named.size):
        raise ConfigError(f"PlanConfig.devices={plan.devices}, but {hardware.name}'s file "
                          f"names {named.size} devices")  # fmt: skip
    target = named or hardware.target(plan.devices)
    return target, hardware.device_memory_gb * 1e9


def _precision_words(precision: StatePrecision) -> str:
    if precision.mode in ("mixed", "fp8"):
        fp8 = (
            "; FP8 GEMMs for the layers' matmuls, their scales and amax histories replicated"
            if precision.mode == "fp8"
            else ""
        )
        return (
            f"mixed precision ({precision.parameters} working copy, {precision.gradients} "
            f"gradients, fp32 master in the optimizer state{fp8})"
        )
    return "fp32 parameters, gradients and optimizer state"


def _stage_row(stage: StagePlan, pipelines: bool = False) -> str:
    """The stage's row of format_plan's table."""
    gb, analysis = 1e9, stage.analysis
    state, xla = analysis.model_state_per_device, analysis.memory_per_device
    formula = state.zero_formula_bytes
    measured = state.xla_parameters_and_optimizer_bytes + state.gradient_bytes
    collectives = ", ".join(
        f"{kind} {total.count}× {format_bytes(total.bytes)}"
        for kind, total in analysis.collectives.by_kind.items()
    )
    chosen = analysis.remat
    remat = f" (remat auto → {chosen.policy})" if chosen.requested == "auto" else ""
    kernels = analysis.kernels
    program = (
        " | " + ", ".join(f"{kind} {getattr(kernels, kind).count:,}" for kind in KERNEL_COLUMNS)
        if kernels else ""
    )  # fmt: skip
    pipeline = f"| {analysis.pipeline} (batch {analysis.batch_size}) " if pipelines else ""
    return (
        f"{pipeline}| {analysis.zero_stage}{remat} | {stage.parameters_per_device:,} | {state.zero_formula} | "
        f"{formula.parameters / gb:.3g} + {formula.gradients / gb:.3g} + "
        f"{formula.optimizer_state / gb:.3g} = {formula.total / gb:.3g} | "
        f"{measured / gb:.3g} | {xla.argument_bytes / gb:.3g}, {xla.temp_bytes / gb:.3g}, "
        f"{xla.peak_estimate_bytes / gb:.3g} | {'yes' if stage.fits else 'no'} | "
        f"{collectives or 'none'}{program} |{_ici_cell(stage)}"
    )


def _ici_cell(stage: StagePlan) -> str:
    """A TPU plan's column: the collectives' time per step over ICI, and over DCN."""
    if stage.ici_seconds is None:
        return ""
    dcn = f" + DCN {stage.dcn_seconds * 1e3:.3g} ms" if stage.dcn_seconds else ""
    program, formula = stage.dcn_program, stage.dcn_formula
    moved = (
        f" {format_bytes(program.total)} ({format_bytes(formula.total)}) |"
        if program is not None and formula is not None else " – |"
    )  # fmt: skip
    return f" ICI {stage.ici_seconds * 1e3:.3g} ms{dcn} |{moved}"


def format_plan(result: Plan) -> str:
    run, plan = result.run, result.plan
    first = result.stages[0].analysis
    read = first.kernels is not None  # a GPU or TPU program's operations
    tpu = result.stages[0].ici_seconds is not None
    pipelined = any(stage.analysis.pipeline > 1 for stage in result.stages)
    lines = [
        f"{run.model.name} on {plan.devices} devices (tensor {plan.tensor}), "
        f"{result.device_memory_gb:g} GB each, compiled by {result.compiler}; {run.optimizer.name}, {run.model.dtype} "
        f"compute, {_precision_words(first.precision)}, remat {run.model.remat}, lengths "
        f"{run.data.input_length}/{run.data.target_length}, batch {first.batch_size}",
        "",
        ("| pipeline " if pipelined else "")
        + "| stage | params/device | ZeRO formula | formula GB (params + grads + optimizer) | "
        "model state GB from XLA | XLA GB/device (arguments, temp, peak) | fits | "
        "collectives per step |"
        + (f" {'TPU operations' if tpu else 'GPU kernels'} per step |" if read else "")
        + (
            " collectives' time per step, none hidden | DCN bytes per chip per step (formula) |"
            if tpu
            else ""
        ),
        ("|---" if pipelined else "")
        + "|---|---|---|---|---|---|---|---|"
        + ("---|" if read else "")
        + ("---|---|" if tpu else ""),
        *(_stage_row(stage, pipelined) for stage in result.stages),
        "",
        "fits: XLA's per-device peak (arguments + outputs - aliased + temp) within the device "
        "memory. Model state from XLA: the step's arguments less the batch (parameters and "
        "optimizer state) plus the gradients' bytes under their sharding. Collective bytes are "
        "each collective's result size per device, summed over the step."
        + (
            f" {'TPU operations' if tpu else 'GPU kernels'}: launches per step, loops multiplied "
            "out (copy: copies and transposes; attention: fused attention calls; collective: "
            "async pairs and synchronous collectives; `plan --json` adds their bytes)."
            if read
            else ""
        )
        + (
            " Collectives' time: each over the torus axes its replica group spans (rings where "
            "they wrap), the scaling book's model; between slices, each chip's share of its "
            "host's DCN; none hidden behind compute, no DCN latency. A lower bound, unvalidated. "
            "DCN bytes: what each chip hands the slow network per step (an all-reduce's or "
            "reduce-scatter's operand, an all-gather's own part), read from the program, and in "
            "brackets what the stage needs laid out hierarchically (docs/cluster_model.md, "
            '"ZeRO across slices").'
            if tpu
            else ""
        ),
    ]
    return "\n".join(lines)
