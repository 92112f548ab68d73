"""The planner: per ZeRO stage, what a model needs per device on N devices, without a step.

    t5scale plan --gin_file=gin/models/mt5_xxl.gin --gin.DEVICES=64 --gin.DEVICE_MEMORY_GB=80

For each stage it compiles the train step on N emulated CPU devices (nothing is allocated) and
gives parameters per device, model-state bytes per device by the ZeRO formula, XLA's compiled
per-device memory (argument, temp, peak), whether that fits DEVICE_MEMORY_GB, and the bytes each
collective moves per step. XLA's CPU compiler fuses and schedules differently from a GPU's, so
its temp bytes are an estimate of a GPU's; the model-state bytes are exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from t5scale.analysis.hlo import KINDS, format_bytes
from t5scale.train.config import ConfigError, RunConfig

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """devices: the mesh to plan for (zero = devices / tensor, replica 1); the batch is
    micro_batch_size × data-parallel devices × MICRO_BATCHES, as in the study."""

    devices: int = 8
    device_memory_gb: float = 80.0
    stages: tuple[int, ...] = (0, 1, 2, 3)
    micro_batch_size: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if self.devices < 1 or self.devices % self.tensor:
            raise ConfigError(
                f"PlanConfig.devices={self.devices} must be a positive multiple of "
                f"tensor={self.tensor}"
            )
        if self.device_memory_gb <= 0 or self.micro_batch_size < 1:
            raise ConfigError("PlanConfig.device_memory_gb must be > 0, micro_batch_size >= 1")
        if bad := [s for s in self.stages if s not in (0, 1, 2, 3)]:
            raise ConfigError(f"PlanConfig.stages: ZeRO stages are 0-3, got {bad}")


def stage_run(run: RunConfig, plan: PlanConfig, stage: int) -> RunConfig:
    """The run the planner compiles for `stage`: zero over every data-parallel device."""
    data_parallel = plan.devices // plan.tensor
    batch = plan.micro_batch_size * data_parallel * run.train.micro_batches
    parallel = dataclasses.replace(
        run.parallel, zero_stage=stage, replica=1, zero=data_parallel, tensor=plan.tensor
    )
    return dataclasses.replace(
        run, parallel=parallel, train=dataclasses.replace(run.train, batch_size=batch)
    )


def plan_stage(run: RunConfig, plan: PlanConfig, stage: int, devices) -> dict[str, Any]:
    from t5scale.study.measure import compile_step

    staged = stage_run(run, plan, stage)
    step = compile_step(staged, devices)
    a = step.analysis
    budget = plan.device_memory_gb * 1e9
    peak = a["memory_per_device"]["peak_estimate_bytes"]
    formula = a["model_state_per_device"]["zero_formula_bytes"]
    return {
        "stage": stage,
        "mesh": a["mesh"],
        "batch_size": staged.train.batch_size,
        "parameters": a["parameters"],
        "parameters_per_device": step.plan.parameters_per_device(),
        "zero_formula_bytes": formula,
        "xla_memory_per_device": a["memory_per_device"],
        "device_memory_bytes": budget,
        "fits": peak <= budget,
        "fits_model_state": formula["total"] <= budget,
        "collectives": a["collectives"],
        "flops_per_step": a["flops_per_step"],
        "compile_time_s": a["compile_time_s"],
    }


def run_plan(run: RunConfig, plan: PlanConfig, show=print) -> dict[str, Any]:
    import jax

    if jax.device_count() < plan.devices:
        raise ConfigError(f"{plan.devices} devices to plan for, {jax.device_count()} emulated")
    devices = jax.devices()[: plan.devices]
    stages = []
    for stage in plan.stages:
        stages.append(plan_stage(run, plan, stage, devices))
        show(f"stage {stage}: compiled in {stages[-1]['compile_time_s']:.1f} s")
    return {
        "model": run.model.name,
        "devices": plan.devices,
        "tensor": plan.tensor,
        "device_memory_gb": plan.device_memory_gb,
        "dtype": run.model.dtype,
        "remat": run.model.remat,
        "optimizer": run.optimizer.name,
        "lengths": [run.data.input_length, run.data.target_length],
        "stages": stages,
    }


def format_plan(result: dict[str, Any]) -> str:
    gb = 1e9
    lines = [
        f"{result['model']} on {result['devices']} devices (tensor {result['tensor']}), "
        f"{result['device_memory_gb']:g} GB each; {result['optimizer']}, {result['dtype']} "
        f"compute, remat {result['remat']}, lengths {result['lengths'][0]}/{result['lengths'][1]}, "
        f"batch {result['stages'][0]['batch_size']}",
        "",
        "| stage | params/device | ZeRO formula GB (params + grads + optimizer) | "
        "XLA GB/device (arguments, temp, peak) | fits | collectives per step |",
        "|---|---|---|---|---|---|",
    ]
    for s in result["stages"]:
        f, x = s["zero_formula_bytes"], s["xla_memory_per_device"]
        collectives = ", ".join(
            f"{k} {s['collectives'][k]['count']}× {format_bytes(s['collectives'][k]['bytes'])}"
            for k in KINDS
            if k in s["collectives"]
        )
        lines.append(
            f"| {s['stage']} | {s['parameters_per_device']:,} | "
            f"{f['parameters'] / gb:.3g} + {f['gradients'] / gb:.3g} + "
            f"{f['optimizer_state'] / gb:.3g} = {f['total'] / gb:.3g} | "
            f"{x['argument_bytes'] / gb:.3g}, {x['temp_bytes'] / gb:.3g}, "
            f"{x['peak_estimate_bytes'] / gb:.3g} | {'yes' if s['fits'] else 'no'} | "
            f"{collectives or 'none'} |"
        )
    lines.append("")
    lines.append(
        "fits: XLA's per-device peak (arguments + outputs - aliased + temp) within the device "
        "memory; collective bytes are each collective's result size per device, summed over "
        "the step."
    )
    return "\n".join(lines)
