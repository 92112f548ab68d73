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

import jax

from t5scale.analysis.hlo import KINDS, format_bytes
from t5scale.errors import ConfigError
from t5scale.parallel.zero import check_stages
from t5scale.train.config import RunConfig
from t5scale.train.setup import build_setup

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
        check_stages(self.stages, "PlanConfig.stages")


def stage_run(run: RunConfig, plan: PlanConfig, stage: int, replicas: int = 1) -> RunConfig:
    """The run the planner compiles for `stage`: zero over every data-parallel device (of each
    of `replicas` replicas: local SGD, DiLoCo)."""
    data_parallel = plan.devices // plan.tensor
    batch = plan.micro_batch_size * data_parallel * run.train.micro_batches
    parallel = dataclasses.replace(
        run.parallel, zero_stage=stage, replica=replicas, zero=data_parallel // replicas,
        tensor=plan.tensor,
    )  # fmt: skip
    return dataclasses.replace(
        run, parallel=parallel, train=dataclasses.replace(run.train, batch_size=batch)
    )


def plan_stage(run: RunConfig, plan: PlanConfig, stage: int, devices) -> dict[str, Any]:
    staged = stage_run(run, plan, stage)
    budget = plan.device_memory_gb * 1e9
    step = build_setup(staged, devices).compile(memory_budget_bytes=int(budget))
    analysis = step.analysis
    peak = analysis["memory_per_device"]["peak_estimate_bytes"]
    formula = analysis["model_state_per_device"]["zero_formula_bytes"]
    return {
        "stage": stage,
        "remat": analysis["remat"],
        "mesh": analysis["mesh"],
        "batch_size": staged.train.batch_size,
        "parameters": analysis["parameters"],
        "precision": analysis["precision"],
        "parameters_per_device": step.setup.layout.parameters_per_device(),
        "zero_formula_bytes": formula,
        "zero_formula": analysis["model_state_per_device"]["zero_formula"],
        "padded": analysis["padded"],
        "xla_memory_per_device": analysis["memory_per_device"],
        "xla_model_state_per_device": analysis["model_state_per_device"],
        "device_memory_bytes": budget,
        "fits": peak <= budget,
        "fits_model_state": formula["total"] <= budget,
        "collectives": analysis["collectives"],
        "flops_per_step": analysis["flops_per_step"],
        "compile_time_s": analysis["compile_time_s"],
    }


def run_plan(run: RunConfig, plan: PlanConfig, show=print) -> dict[str, Any]:
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
        "precision": stages[0]["precision"] if stages else None,
        "remat": run.model.remat,
        "optimizer": run.optimizer.name,
        "lengths": [run.data.input_length, run.data.target_length],
        "stages": stages,
    }


def _precision_words(precision: dict[str, Any]) -> str:
    if precision["mode"] == "mixed":
        return (
            f"mixed precision ({precision['parameters']} working copy, {precision['gradients']} "
            "gradients, fp32 master in the optimizer state)"
        )
    return "fp32 parameters, gradients and optimizer state"


def format_plan(result: dict[str, Any]) -> str:
    gb = 1e9
    first = result["stages"][0]
    lines = [
        f"{result['model']} on {result['devices']} devices (tensor {result['tensor']}), "
        f"{result['device_memory_gb']:g} GB each; {result['optimizer']}, {result['dtype']} "
        f"compute, {_precision_words(result['precision'])}, remat {result['remat']}, lengths "
        f"{result['lengths'][0]}/{result['lengths'][1]}, batch {first['batch_size']}",
        "",
        "| stage | params/device | ZeRO formula | formula GB (params + grads + optimizer) | "
        "model state GB from XLA | XLA GB/device (arguments, temp, peak) | fits | "
        "collectives per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stage in result["stages"]:
        formula, xla = stage["zero_formula_bytes"], stage["xla_memory_per_device"]
        state = stage["xla_model_state_per_device"]
        measured = state["xla_parameters_and_optimizer_bytes"] + state["gradient_bytes"]
        found = stage["collectives"]
        collectives = ", ".join(
            f"{kind} {found[kind]['count']}× {format_bytes(found[kind]['bytes'])}"
            for kind in KINDS
            if kind in found
        )
        chosen = stage["remat"]
        remat = f" (remat auto → {chosen['policy']})" if chosen["requested"] == "auto" else ""
        lines.append(
            f"| {stage['stage']}{remat} | {stage['parameters_per_device']:,} | {stage['zero_formula']} | "
            f"{formula['parameters'] / gb:.3g} + {formula['gradients'] / gb:.3g} + "
            f"{formula['optimizer_state'] / gb:.3g} = {formula['total'] / gb:.3g} | "
            f"{measured / gb:.3g} | {xla['argument_bytes'] / gb:.3g}, {xla['temp_bytes'] / gb:.3g}, "
            f"{xla['peak_estimate_bytes'] / gb:.3g} | {'yes' if stage['fits'] else 'no'} | "
            f"{collectives or 'none'} |"
        )
    lines.append("")
    lines.append(
        "fits: XLA's per-device peak (arguments + outputs - aliased + temp) within the device "
        "memory. Model state from XLA: the step's arguments less the batch (parameters and "
        "optimizer state) plus the gradients' bytes under their sharding. Collective bytes are "
        "each collective's result size per device, summed over the step."
    )
    return "\n".join(lines)
