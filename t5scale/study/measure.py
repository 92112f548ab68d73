"""Time a compiled train step on synthetic batches: shared by the study's trials and bench/."""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from t5scale.data.loader import host_batches
from t5scale.train.config import ConfigError, RunConfig
from t5scale.train.replicas import combine_replica_metrics
from t5scale.train.setup import CompiledStep, build_setup


def model_state_per_device(run: RunConfig, devices=None) -> float:
    """Bytes of parameters, gradients and optimizer state per device by the ZeRO formula: a
    lower bound of the step's memory, known without compiling."""
    setup = build_setup(run, devices)
    return setup.model_state_bytes().per_device(setup.layout.stage, setup.layout.zero_size)["total"]


def time_steps(step: CompiledStep, warmup: int, timed: int) -> dict[str, Any]:
    """Run `warmup` then `timed` executions on synthetic batches, each timed to
    block_until_ready; with k steps per execution each gives its time over k as the step time.

    With local SGD or DiLoCo the outer step runs where it is due, inside the time of the step
    it follows; the timed steps are a multiple of H and the step time is their mean, so that
    each step carries its 1/H of the synchronisation."""
    setup, k = step.setup, step.steps_per_execution
    run = setup.run
    local = setup.outer_tx is not None
    if local:
        every = run.sync.every
        if every % k:
            raise ConfigError(
                f"steps_per_execution={k} must divide ReplicaSyncConfig.every={every}"
            )
        timed = -(-timed * k // every) * every // k  # any H steps in a row hold one outer step
    stream = host_batches(run.data, run.train.batch_size, run.train.seed, run.model.vocab_size)

    def next_batch():
        batches = [
            jax.make_array_from_process_local_data(setup.batch_sharding(), next(stream))
            for _ in range(k)
        ]
        return batches[0] if k == 1 else setup.stack(batches)

    state = setup.create_state()
    times, losses = [], []
    for index in range(warmup + timed):
        batch = next_batch()
        started = time.perf_counter()
        state, metrics = step.compiled(state, batch)
        if local:
            if run.sync.due((index + 1) * k):
                state = setup.compiled_outer.compiled(state)
            metrics = combine_replica_metrics(multihost_utils.process_allgather(metrics, True))
        jax.block_until_ready((state, metrics))
        if index >= warmup:
            times.extend([(time.perf_counter() - started) / k] * k)
        losses.extend(float(x) for x in np.atleast_1d(jax.device_get(metrics["loss"])))
    del state
    median = statistics.fmean(times) if local else statistics.median(times)
    return {
        "step_time_s": {
            "median": median,  # with local SGD or DiLoCo: the mean over whole rounds
            "statistic": "mean over whole rounds" if local else "median",
            "min": min(times),
            "max": max(times),
            # spread: (max - min) / median over the timed steps
            "spread": (max(times) - min(times)) / median,
            "timed_steps": len(times),
            "warmup_steps": warmup * k,
            "steps_per_execution": k,
        },
        "step_times_s": times,
        "losses": losses,
        "allocator_peak_bytes": allocator_peak(setup.mesh),
    }


def allocator_peak(mesh) -> int | None:
    """The largest allocator peak over the mesh's devices, where the backend reports one."""
    peaks = []
    for device in mesh.devices.flat:
        stats = device.memory_stats() if device.process_index == jax.process_index() else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None
