"""Compile a train step without allocating the state, and time it: shared by trial and plan."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax

from t5scale.analysis.memory import model_state_bytes
from t5scale.parallel.mesh import make_mesh
from t5scale.parallel.zero import get_stage
from t5scale.train import optim
from t5scale.train.config import RunConfig
from t5scale.train.loop import check_batch, compile_train_step
from t5scale.train.state import (
    abstract_state,
    create_state,
    plan_for,
    state_initializer,
    state_shardings,
)
from t5scale.train.step import batch_sharding


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    compiled: Any
    plan: Any
    tx: Any
    analysis: dict[str, Any]


def compile_step(run: RunConfig, devices=None) -> CompiledStep:
    """The run's train step, lowered from abstract shapes and compiled; nothing is allocated."""
    mesh = make_mesh(run.parallel, devices)
    check_batch(run, mesh)
    tx = optim.make_optimizer(run.optimizer)
    plan = plan_for(run.model, run.parallel.zero_stage, mesh)
    abstract = abstract_state(run.model, tx)
    shardings = state_shardings(plan, tx, abstract)
    compiled, analysis = compile_train_step(run, plan, tx, abstract, shardings)
    return CompiledStep(compiled, plan, tx, analysis)


def compile_state_init(run: RunConfig, step: CompiledStep) -> None:
    """Compile (not run) the state's init, so that a persistent compilation cache holds it."""
    key = jax.random.key(run.train.seed)
    state_initializer(run.model, step.tx, step.plan).lower(key).compile()


def model_state_per_device(run: RunConfig, devices=None) -> float:
    """Bytes of parameters, gradients and optimizer state per device by the ZeRO formula: a
    lower bound of the step's memory, known without compiling."""
    mesh = make_mesh(run.parallel, devices)
    state = abstract_state(run.model, optim.make_optimizer(run.optimizer))
    stage = get_stage(run.parallel.zero_stage)
    return model_state_bytes(state.params, state.opt_state).per_device(stage, mesh.shape["zero"])[
        "total"
    ]


def time_steps(run: RunConfig, step: CompiledStep, warmup: int, timed: int) -> dict[str, Any]:
    """Run warm-up then timed steps on synthetic batches, each timed to block_until_ready."""
    from t5scale.data.loader import host_batches

    sharding = batch_sharding(step.plan)
    stream = host_batches(run.data, run.train.batch_size, run.train.seed, run.model.vocab_size)
    state = create_state(run.model, step.tx, step.plan, run.train.seed)
    times, losses = [], []
    for index in range(warmup + timed):
        batch = jax.make_array_from_process_local_data(sharding, next(stream))
        started = time.perf_counter()
        state, metrics = step.compiled(state, batch)
        jax.block_until_ready((state, metrics))
        if index >= warmup:
            times.append(time.perf_counter() - started)
        losses.append(float(metrics["loss"]))
    del state
    median = statistics.median(times)
    return {
        "step_time_s": {
            "median": median,
            "min": min(times),
            "max": max(times),
            # spread: (max - min) / median over the timed steps
            "spread": (max(times) - min(times)) / median,
            "timed_steps": len(times),
            "warmup_steps": warmup,
        },
        "step_times_s": times,
        "losses": losses,
        "allocator_peak_bytes": allocator_peak(step.plan.mesh),
    }


def allocator_peak(mesh) -> int | None:
    """The largest allocator peak over the mesh's devices, where the backend reports one."""
    peaks = []
    for device in mesh.devices.flat:
        stats = device.memory_stats() if device.process_index == jax.process_index() else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None
