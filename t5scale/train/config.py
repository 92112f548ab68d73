"""The run configuration: frozen dataclasses, one per concern, bundled in RunConfig."""

from __future__ import annotations

import dataclasses

from t5scale.data.config import DataConfig
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train import optim


class ConfigError(ValueError):
    """A configuration that cannot run (reported in one line, exit code 2)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    batch_size: int = 8  # global, in sequences
    micro_batches: int = 1  # gradient accumulation steps per train step
    seed: int = 0
    log_every: int = 1
    z_loss: float = 1e-4
    model_dir: str | None = None

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.micro_batches < 1:
            raise ConfigError("steps must be >= 0, batch_size and micro_batches >= 1")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    optimizer: optim.OptimizerConfig = optim.OptimizerConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
