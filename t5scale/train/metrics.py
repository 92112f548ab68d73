"""Step metrics: what one train step measures (`StepMetrics`, a pytree the compiled step
returns), one JSON line per step in MODEL_DIR/metrics.jsonl (`StepRecord`), and progress on the
terminal."""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import flax.struct
import jax
import numpy as np

from t5scale.jsonform import JsonRecord


# A pytree (flax.struct), not a plain dataclass: it crosses jit's output, lax.scan stacks it
# (a value per step) and vmap maps it (a value per replica), and device_get keeps its type.
@flax.struct.dataclass
class StepMetrics:
    """The losses a train step measured (means over its target tokens), its target tokens, the
    gradient norm, and `nonfinite`: 1.0 where the loss or the gradient norm is NaN or Inf. Each
    field is an array, or on the host a float once split by `per_step`."""

    # In the order of their names: the order the compiled step gave them in when they were a
    # dict (a pytree's keys sorted), so that the program is the same.
    cross_entropy: Any
    grad_norm: Any
    loss: Any
    nonfinite: Any
    target_tokens: Any
    z_loss: Any

    def per_step(self) -> list[StepMetrics]:
        """One record of floats per step an execution took (each field a value, or one per step
        with several steps per execution), on the host."""
        values = jax.tree.map(lambda x: np.atleast_1d(np.asarray(x)), self)
        return [jax.tree.map(lambda x, i=i: float(x[i]), values) for i in range(len(values.loss))]

    def over_replicas(self) -> StepMetrics:
        """One value per step from a value per replica (the last axis), on the host: the losses
        weighted by each replica's target tokens (what one synchronous step over the global
        batch reports), the tokens summed, the gradient norm averaged, non-finite if any
        replica was (local SGD, DiLoCo: t5scale/train/replicas.py)."""
        per_replica = jax.tree.map(lambda x: np.asarray(x, np.float64), self)
        tokens = per_replica.target_tokens
        weights = tokens / np.maximum(tokens.sum(axis=-1, keepdims=True), 1.0)

        def weighted(values: np.ndarray) -> np.ndarray:
            return (values * weights).sum(axis=-1)

        return StepMetrics(
            loss=weighted(per_replica.loss),
            cross_entropy=weighted(per_replica.cross_entropy),
            z_loss=weighted(per_replica.z_loss),
            target_tokens=tokens.sum(axis=-1),
            grad_norm=per_replica.grad_norm.mean(axis=-1),
            nonfinite=per_replica.nonfinite.max(axis=-1),
        )


@flax.struct.dataclass
class LossSums:
    """Losses summed over a batch's target tokens, and those tokens: what the gradients'
    pass (train/gradients.py) and the eval step return."""

    cross_entropy: Any
    z_loss: Any
    target_tokens: Any


@dataclasses.dataclass(frozen=True)
class StepMeasures:
    """What the run measures of a step beside the step itself (t5scale/train/instruments.py):
    MFU and memory, each None (null in metrics.jsonl) where not known."""

    mfu: float | None
    memory_peak_bytes: int | None
    memory_xla_estimate_bytes: int | None


@dataclasses.dataclass(frozen=True)
class StepRecord(JsonRecord):
    """One line of metrics.jsonl. The fields are in the file's order: the step, its metrics by
    name (as jax returned them from a dict, sorted), then what the loop adds. `skipped_steps` is
    left out of the record of a non-finite step that stops the run, `validation_loss` where no
    validation was due."""

    step: int
    cross_entropy: float
    grad_norm: float
    loss: float
    nonfinite: float
    target_tokens: float
    z_loss: float
    learning_rate: float
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    memory_peak_bytes: int | None
    memory_xla_estimate_bytes: int | None
    skipped_steps: int | None = None
    validation_loss: float | None = None

    @classmethod
    def of(
        cls,
        step: int,
        metrics: StepMetrics,
        learning_rate: float,
        step_time_s: float,
        tokens_per_s: float,
        measures: StepMeasures,
    ) -> StepRecord:
        """The record of `step` from its metrics (floats: StepMetrics.per_step) and measures."""
        return cls(
            step=step,
            cross_entropy=metrics.cross_entropy,
            grad_norm=metrics.grad_norm,
            loss=metrics.loss,
            nonfinite=metrics.nonfinite,
            target_tokens=metrics.target_tokens,
            z_loss=metrics.z_loss,
            learning_rate=learning_rate,
            step_time_s=step_time_s,
            tokens_per_s=tokens_per_s,
            mfu=measures.mfu,
            memory_peak_bytes=measures.memory_peak_bytes,
            memory_xla_estimate_bytes=measures.memory_xla_estimate_bytes,
        )


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _keep_records_up_to(path: Path, step: int) -> None:
    """Rewrite `path` (atomically) with only its records of steps 1..`step`."""
    if not path.exists():
        return
    kept = []
    # errors="replace": bytes that are not UTF-8 (a disk's damage) make their line no record
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill, or damaged
    partial = path.with_suffix(".jsonl.partial")
    partial.write_text("".join(kept), encoding="utf-8")
    partial.replace(path)


class MetricsLog:
    """Appends one JSON object per step and prints a progress line every `print_every` steps.

    A run resumed at step `resume_at` first drops the records after that step (a killed run may
    have logged steps it never checkpointed), so the file reads as one uninterrupted run.
    """

    def __init__(
        self,
        model_dir: str | None,
        total_steps: int,
        print_every: int = 1,
        stream: TextIO | None = None,
        resume_at: int = 0,
        show: bool = True,
    ):
        self.total_steps = total_steps
        self.print_every = max(1, print_every)
        self.show = show  # False: file only (the processes other than process 0)
        self.stream = stream or sys.stdout  # looked up now: sys.stdout may be replaced
        self.step_times: list[float] = []
        self.started = time.perf_counter()
        self.file = None
        if model_dir:
            Path(model_dir).mkdir(parents=True, exist_ok=True)
            path = Path(model_dir) / "metrics.jsonl"
            _keep_records_up_to(path, resume_at)
            self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: StepRecord) -> None:
        self.step_times.append(record.step_time_s)
        if self.file:
            self.file.write(json.dumps(record.to_json()) + "\n")
            self.file.flush()
        step = record.step
        if self.show and (step % self.print_every == 0 or step == self.total_steps):
            # The median of recent steps is robust to a slow first step or a hiccup.
            recent = statistics.median(self.step_times[-20:])
            eta = _duration(recent * (self.total_steps - step))
            print(
                f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}  "
                f"loss {record.loss:.4f}  {record.tokens_per_s:,.0f} tokens/s  "
                f"{record.step_time_s:.3f} s/step  ETA {eta}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.file:
            self.file.close()
