"""A jax.profiler trace of chosen train steps, for TensorBoard's profile plugin or
ui.perfetto.dev: the training loop's (TrainConfig.profile_steps) and the study's
(t5scale/study/measure.py, `profile_steps`) alike.

Each step is marked with `step_annotation`, which is how the profile plugin tells steps apart.
The trace holds the host's runtime and the devices' events, not every Python call (jax's default
Python tracer): inside a traced step those are JAX's own tracing of a program compiled there (a
validation step, say), 0.5M events for two steps of mt5_tiny, whose export took 12 s of the
2-core VM's 19-s run (2026-11-29).
"""

from __future__ import annotations

from pathlib import Path

import jax


def step_annotation(step: int) -> jax.profiler.StepTraceAnnotation:
    """The context in which train step `step` runs, as a trace shows it."""
    return jax.profiler.StepTraceAnnotation("train", step_num=step)


class StepTrace:
    """A trace of steps first..last into `logdir`, started before the execution that holds the
    first and stopped after the one that holds the last (or at `close`, where the steps ended
    early or failed)."""

    def __init__(self, logdir: str | Path, first: int, last: int):
        self.logdir, self.first, self.last = str(logdir), first, last
        self.tracing = False

    def before(self, first: int, last: int) -> None:
        """Before the execution of steps first..last: start if it holds the first traced one."""
        if not self.tracing and first <= self.first <= last:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            jax.profiler.start_trace(
                self.logdir, create_perfetto_trace=True, profiler_options=options
            )
            self.tracing = True

    def after(self, last: int) -> bool:
        """After steps up to `last` (finished on the device): whether that ended the trace."""
        if self.tracing and last >= self.last:
            self.close()
            return True
        return False

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
