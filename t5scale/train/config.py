"""The run configuration: frozen dataclasses, one per concern, bundled in RunConfig."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Self

from t5scale.data.config import DataConfig
from t5scale.errors import ConfigError, check_field_types
from t5scale.jsonform import JsonRecord
from t5scale.model.sizes import RENAMED_REMATS, ModelConfig
from t5scale.parallel.distributed import DistributedConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train import optim
from t5scale.train.precision import PrecisionConfig, resolve
from t5scale.train.replicas import ReplicaSyncConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    batch_size: int = 8  # global, in sequences
    micro_batches: int = 1  # gradient accumulation steps per train step
    # Train steps per XLA execution (a loop inside the compiled program; t5scale/train/step.py).
    steps_per_execution: int = 1
    seed: int = 0
    log_every: int = 1
    z_loss: float = 1e-4
    model_dir: str | None = None
    # TensorBoard event files in MODEL_DIR/train and MODEL_DIR/validation (process 0).
    tensorboard: bool = True
    # (first, last): a jax.profiler trace of steps first..last into MODEL_DIR/profile, for
    # TensorBoard's profile plugin or Perfetto (ui.perfetto.dev). None: no trace.
    profile_steps: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.steps < 0 or self.batch_size < 1 or self.micro_batches < 1:
            raise ConfigError("steps must be >= 0, batch_size and micro_batches >= 1")
        for name, low in (("seed", 0), ("log_every", 1), ("z_loss", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"TrainConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if self.profile_steps is not None:
            object.__setattr__(self, "profile_steps", tuple(self.profile_steps))  # gin: a list
            first, last = self.profile_steps
            if not 1 <= first <= last <= self.steps:  # a later step is never traced
                raise ConfigError(
                    f"TrainConfig.profile_steps must be (first, last) with 1 <= first <= last "
                    f"<= steps ({self.steps}), got {self.profile_steps}"
                )
            if not self.model_dir:
                raise ConfigError("TrainConfig.profile_steps writes into MODEL_DIR: give "
                                  "--gin.MODEL_DIR=/path")  # fmt: skip
        if self.steps_per_execution < 1:
            raise ConfigError(
                f"TrainConfig.steps_per_execution must be >= 1, got {self.steps_per_execution}"
            )


def check_output_dir(path: str | Path, name: str) -> None:
    """A ConfigError in one line unless `path` is a directory this process can write into, or
    one it can make: checked before a command's work, so that nothing is read or computed for
    an output that cannot be written."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name} {str(path)!r} is a file, not a directory")
    existing = path if path.exists() else next(p for p in path.parents if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{name} {str(path)!r} cannot be made: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} {str(path)!r}: {str(existing)!r} is not writable")


def make_model_dir(path: str) -> None:
    """MODEL_DIR, created if it is not there, or a ConfigError that says why it cannot be."""
    if Path(path).exists() and not Path(path).is_dir():
        raise ConfigError(f"MODEL_DIR {path!r} is a file, not a directory")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file on the way, no permission, /proc …
        reason = error.strerror or type(error).__name__
        raise ConfigError(f"MODEL_DIR {path!r} cannot be used as a directory: {reason}") from None
    # Here, not at the first save: a run would train until then, and lose it.
    for directory in (Path(path), Path(path) / "checkpoints"):
        if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError(f"MODEL_DIR {path!r}: {str(directory)!r} is not writable")


LOCK_FILE = ".t5scale.lock"


@contextlib.contextmanager
def model_dir_lock(path: str) -> Iterator[None]:
    """MODEL_DIR held for one run at a time (its process 0 holds the lock): two runs on one
    directory wrote over each other's checkpoints and metrics, and one of them hung in a
    save. A ConfigError in one line names the holder; a file system without locks skips it."""
    lock_path = Path(path) / LOCK_FILE
    with open(lock_path, "a+", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise ConfigError(
                f"MODEL_DIR {path!r} is in use by another run ({holder}): wait for it to end, "
                "or give this run another MODEL_DIR"
            ) from None
        except OSError:  # no locks here (some network file systems): run unguarded
            yield
            return
        lock.seek(0)
        lock.truncate()
        lock.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


NONFINITE_ACTIONS = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When to save (t5scale/train/checkpoint.py), how many to keep, what a NaN or Inf does.

    every: steps between checkpoints (0: only at the last step and on preemption).
    on_nonfinite: 'stop' (save nothing more, exit non-zero) or 'skip' (keep the state as it was
    before the step, count it as `skipped` in metrics.jsonl, go on).
    """

    every: int = 1000
    keep: int = 3
    async_save: bool = True
    on_nonfinite: str = "stop"

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.every < 0 or self.keep < 1:
            raise ConfigError("CheckpointConfig.every must be >= 0 and keep >= 1")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ConfigError(
                f"CheckpointConfig.on_nonfinite must be stop or skip, got {self.on_nonfinite!r}"
            )


@dataclasses.dataclass(frozen=True)
class RunConfig(JsonRecord):
    """One run, whole: the value that crosses modules, processes (a trial's spec) and
    checkpoints (their meta), as JSON at those edges (`to_json`, `from_json`: a field a file
    lacks takes its default). gin builds it at the command's edge (t5scale/config.py)."""

    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    optimizer: optim.OptimizerConfig = optim.OptimizerConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()
    precision: PrecisionConfig = PrecisionConfig()
    sync: ReplicaSyncConfig = ReplicaSyncConfig()

    def __post_init__(self) -> None:
        # A ValueError where the two disagree. local SGD or DiLoCo on one replica is refused by
        # the training loop only: `simulate` times its outer step on one node too.
        resolve(self.precision, self.model.dtype)
        # The model's matmuls follow the precision: FP8 ones only in mode 'fp8'.
        history = self.precision.fp8_amax_history if self.precision.mode == "fp8" else None
        if self.model.fp8_amax_history != history:
            model = dataclasses.replace(self.model, fp8_amax_history=history)
            object.__setattr__(self, "model", model)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """A run from its JSON form; one written before a remat policy was renamed (a
        checkpoint's meta, results.jsonl's `run`) reads as the policy is named now, before
        ModelConfig, which refuses the old name as input, sees it."""
        model = data.get("model")
        remat = model.get("remat") if isinstance(model, Mapping) else None
        if isinstance(remat, str) and remat in RENAMED_REMATS:
            data = dict(data) | {"model": dict(model) | {"remat": RENAMED_REMATS[remat]}}
        return super().from_json(data)

    @property
    def tokens_per_step(self) -> int:
        """Token slots of one global batch, inputs and targets, padding included: what every
        tokens/s in t5scale counts."""
        return self.train.batch_size * (self.data.input_length + self.data.target_length)
