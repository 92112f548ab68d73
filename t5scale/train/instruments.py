"""What a training run reports besides metrics.jsonl: TensorBoard scalars, MFU, memory at run
time beside XLA's estimate, and a profile of chosen steps.

TensorBoard runs: MODEL_DIR/train (per step) and MODEL_DIR/validation (its loss under the same
tag, so that the two curves share a chart). The profile: MODEL_DIR/profile, a jax.profiler trace
of TrainConfig.profile_steps, for TensorBoard's profile plugin or ui.perfetto.dev.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from t5scale.analysis.flops import mfu
from t5scale.analysis.memory import allocator_peak
from t5scale.analysis.peaks import datasheet_peak
from t5scale.analysis.records import StepAnalysis
from t5scale.train.config import RunConfig
from t5scale.train.profiling import StepTrace
from t5scale.train.tensorboard import ScalarWriter

# metrics.jsonl's names → TensorBoard's tags (the loop's other metrics keep their names)
TENSORBOARD_TAGS = {
    "loss": "loss",
    "learning_rate": "learning_rate",
    "grad_norm": "grad_norm",
    "tokens_per_s": "tokens_per_s",
    "mfu": "mfu",
    "memory_peak_bytes": "memory/peak_bytes",
    "memory_xla_estimate_bytes": "memory/xla_estimate_bytes",
}


class Instruments:
    def __init__(self, run: RunConfig, mesh, analysis: StepAnalysis):
        cfg = run.train
        board = Path(cfg.model_dir) if cfg.model_dir and cfg.tensorboard else None
        self.train_board = ScalarWriter(board / "train" if board else None)
        self.validation_board = ScalarWriter(board / "validation" if board else None)
        self.mesh = mesh
        self.model_flops = analysis.flops_per_step.model
        self.xla_estimate = analysis.memory_per_device.peak_estimate_bytes
        # MFU against the datasheet's peak; None where the device has none (the CPU: the study
        # measures the CPU's peak, a run does not spend seconds on it)
        self.peak = datasheet_peak(run.model.dtype)
        self.profile = cfg.profile_steps
        self.profile_dir = Path(cfg.model_dir, "profile") if self.profile else None
        self.trace = StepTrace(self.profile_dir, *self.profile) if self.profile else None

    def measures(self, step_time_s: float) -> dict[str, Any]:
        """The step's MFU and memory: each None (null in metrics.jsonl) where not known."""
        return {
            "mfu": mfu(self.model_flops, step_time_s, self.peak, self.mesh.size)
            if self.peak else None,
            "memory_peak_bytes": allocator_peak(self.mesh),
            "memory_xla_estimate_bytes": self.xla_estimate,
        }  # fmt: skip

    def before(self, first: int, last: int) -> None:
        """Before the execution of steps first..last: start the trace if it holds the first
        profiled step."""
        if self.trace:
            self.trace.before(first, last)

    def after(self, last: int) -> None:
        """After steps up to `last` (finished on the device): stop the trace at its last."""
        if self.trace and self.trace.after(last) and jax.process_index() == 0:
            print(f"profile of steps {self.profile[0]}-{self.profile[1]}: "
                  f"{self.profile_dir} (tensorboard --logdir, or ui.perfetto.dev)",
                  flush=True)  # fmt: skip

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        self.train_board.write(
            step, {tag: record.get(name) for name, tag in TENSORBOARD_TAGS.items()}
        )
        if "validation_loss" in record:
            self.validation_board.write(step, {"loss": record["validation_loss"]})
            self.validation_board.flush()
        # on disk at every step, as metrics.jsonl: a process that dies loses none of them
        self.train_board.flush()

    def close(self) -> None:
        if self.trace:  # the run may have ended (or failed) inside the profiled steps
            self.trace.close()
        self.train_board.close()
        self.validation_board.close()
