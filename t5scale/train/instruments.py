"""What a training run reports besides metrics.jsonl: TensorBoard scalars, MFU, memory at run
time beside XLA's estimate, and a profile of chosen steps.

TensorBoard runs: MODEL_DIR/train (per step) and MODEL_DIR/validation (its loss under the same
tag, so that the two curves share a chart). The profile: MODEL_DIR/profile, a jax.profiler trace
of TrainConfig.profile_steps, for TensorBoard's profile plugin or ui.perfetto.dev.
"""

from __future__ import annotations

from pathlib import Path

import jax

from t5scale.analysis.flops import mfu
from t5scale.analysis.memory import allocator_peak
from t5scale.analysis.peaks import datasheet_peak
from t5scale.analysis.records import StepAnalysis
from t5scale.train.config import RunConfig
from t5scale.train.metrics import StepMeasures, StepRecord
from t5scale.train.profiling import StepTrace
from t5scale.train.tensorboard import ScalarWriter


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

    def measures(self, step_time_s: float) -> StepMeasures:
        """The step's MFU and memory: each None (null in metrics.jsonl) where not known."""
        utilisation = None
        if self.peak:
            utilisation = mfu(self.model_flops, step_time_s, self.peak, self.mesh.size)
        return StepMeasures(
            mfu=utilisation,
            memory_peak_bytes=allocator_peak(self.mesh),
            memory_xla_estimate_bytes=self.xla_estimate,
        )

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

    def write(self, record: StepRecord) -> None:
        """The step's scalars under TensorBoard's tags (metrics.jsonl's names, memory's under
        memory/); one not known (None) is left out."""
        self.train_board.write(record.step, {
            "loss": record.loss,
            "learning_rate": record.learning_rate,
            "grad_norm": record.grad_norm,
            "tokens_per_s": record.tokens_per_s,
            "mfu": record.mfu,
            "memory/peak_bytes": record.memory_peak_bytes,
            "memory/xla_estimate_bytes": record.memory_xla_estimate_bytes,
        })  # fmt: skip
        if record.validation_loss is not None:
            # the same tag in its own run, so that the two curves share a chart
            self.validation_board.write(record.step, {"loss": record.validation_loss})
            self.validation_board.flush()
        # on disk at every step, as metrics.jsonl: a process that dies loses none of them
        self.train_board.flush()

    def close(self) -> None:
        if self.trace:  # the run may have ended (or failed) inside the profiled steps
            self.trace.close()
        self.train_board.close()
        self.validation_board.close()
