"""Time a compiled train step on synthetic batches: shared by the study's trials and bench/."""

from __future__ import annotations

import dataclasses
import time

import jax

from t5scale.analysis.memory import allocator_peak
from t5scale.data.loader import host_batches
from t5scale.errors import ConfigError
from t5scale.study.evidence import Measurement, TimingRule, measure
from t5scale.study.records import StepTimes
from t5scale.train.profiling import StepTrace, step_annotation
from t5scale.train.replicas import ReplicaSyncConfig
from t5scale.train.setup import CompiledStep, Setup


def model_state_per_device(setup: Setup) -> float:
    """Bytes of parameters, gradients and optimizer state per device by the ZeRO formula: a
    lower bound of the step's memory, known without compiling."""
    form = setup.form
    return form.model_state_bytes().per_device(form.layout.stage, form.layout.zero_size).total


@dataclasses.dataclass(frozen=True)
class TimedSteps:
    """What timing a compiled step found: the step time with its interval and how it was
    measured, every sample (the warm-up included), the losses and the allocator's peak."""

    step_time_s: StepTimes
    step_times_s: tuple[float, ...]
    losses: tuple[float, ...]
    allocator_peak_bytes: int | None  # None where the backend reports none (the CPU)


def time_steps(step: CompiledStep, rule: TimingRule, min_steps: int = 0) -> TimedSteps:
    """Run the compiled step on synthetic batches until `rule` is met (evidence.measure): the
    median step time's interval within the rule's precision, or its budget spent; at least
    `min_steps` steps. Each sample is timed to block_until_ready and the warm-up samples are
    found in the timings, not assumed.

    A sample is one execution (with k steps per execution, its time over k) or, with local SGD
    or DiLoCo, one period of H steps with its outer step (its mean step time): each step then
    carries its 1/H of the synchronisation."""
    setup, k = step.setup, step.steps_per_execution
    run = setup.run
    local = run.sync.local
    executions_per_sample = _executions_per_sample(run.sync, k)
    steps_per_sample = k * executions_per_sample
    rule = dataclasses.replace(
        rule,
        min_samples=max(rule.min_samples, -(-min_steps // steps_per_sample)),
        max_samples=max(-(-rule.max_samples // steps_per_sample), rule.floor),
    )
    stream = host_batches(run.data, run.train.batch_size, run.train.seed, run.model.vocab_size)

    def next_batch():
        batches = [
            jax.make_array_from_process_local_data(setup.batch_sharding(), next(stream))
            for _ in range(k)
        ]
        return batches[0] if k == 1 else setup.stack(batches)

    state = setup.create_state()
    losses: list[float] = []

    def sample() -> float:
        nonlocal state
        elapsed = 0.0
        for _ in range(executions_per_sample):
            batch = next_batch()
            started = time.perf_counter()
            state, metrics = step.execute(state, batch, len(losses))
            jax.block_until_ready((state, metrics))
            elapsed += time.perf_counter() - started
            losses.extend(of_step.loss for of_step in jax.device_get(metrics).per_step())
        return elapsed / steps_per_sample

    found = measure(sample, rule)
    del state
    return TimedSteps(
        step_time_s=_step_times(found, rule, steps_per_sample, local),
        step_times_s=tuple(found.samples),
        losses=tuple(losses),
        allocator_peak_bytes=allocator_peak(setup.mesh),
    )


def _executions_per_sample(sync: ReplicaSyncConfig, k: int) -> int:
    """Executions of k steps in one sample: 1, or one period of local SGD's or DiLoCo's H."""
    if not sync.local:
        return 1
    if sync.every % k:
        raise ConfigError(
            f"steps_per_execution={k} must divide ReplicaSyncConfig.every={sync.every}"
        )
    return sync.every // k


def _step_times(
    found: Measurement, rule: TimingRule, steps_per_sample: int, local: bool
) -> StepTimes:
    """The measured samples' summary, in steps."""
    timed = found.samples[found.warmup :]
    summary = found.summary() | {
        "statistic": "median of periods' mean step times" if local else "median",
        "steps_per_sample": steps_per_sample,
        "timed_steps": len(timed) * steps_per_sample,
        "warmup_steps": found.warmup * steps_per_sample,
        "min": min(timed),
        "max": max(timed),
        "spread": (max(timed) - min(timed)) / found.interval.median,  # (max - min) / median
        "precision_asked": rule.precision,
    }
    return StepTimes.from_json(summary)


def profile_steps(step: CompiledStep, logdir: str, steps: int = 3) -> None:
    """A jax.profiler trace of `steps` executions (after one untraced warm-up) into `logdir`,
    for TensorBoard's profile plugin or ui.perfetto.dev; each step annotated as in training."""
    setup = step.setup
    run = setup.run
    stream = host_batches(run.data, run.train.batch_size, run.train.seed, run.model.vocab_size)
    batches = [
        jax.make_array_from_process_local_data(setup.batch_sharding(), next(stream))
        for _ in range(steps + 1)
    ]
    if step.steps_per_execution > 1:
        raise ConfigError("profile the one-step program (steps_per_execution = 1)")
    state, metrics = step.execute(setup.create_state(), batches[0], 0)
    jax.block_until_ready((state, metrics))
    trace = StepTrace(logdir, 1, steps)
    trace.before(1, steps)
    try:
        for index, batch in enumerate(batches[1:], 1):
            with step_annotation(index):
                state, metrics = step.execute(state, batch, index)
                jax.block_until_ready((state, metrics))
    finally:
        trace.close()
