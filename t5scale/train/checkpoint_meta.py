"""What a checkpoint says of itself (its `meta` item, JSON): the step, the data stream's
position, the model's dimensions, the optimizer, how replicas synchronised and the run. A record
without orbax: a StateForm reads it to restore a checkpoint of another synchronisation mode
(t5scale/train/state.py); t5scale/train/checkpoint.py writes and reads it beside the state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from t5scale.errors import ConfigError
from t5scale.jsonform import JsonRecord
from t5scale.model.sizes import DIMENSIONS, ModelConfig
from t5scale.train.config import RunConfig
from t5scale.train.replicas import ReplicaSyncConfig

# The fields that decide parameter shapes, or what the parameters mean: a size's dimensions and
# the relative attention's buckets (the bias table) and reach. dtype and remat may change.
SHAPE_FIELDS = (*DIMENSIONS, "relative_attention_num_buckets", "relative_attention_max_distance")


def model_signature(model: ModelConfig) -> dict[str, int]:
    return {name: getattr(model, name) for name in SHAPE_FIELDS}


@dataclasses.dataclass(frozen=True)
class SavedSync(JsonRecord):
    """How the replicas of the run that saved synchronised: what a run of another mode or
    replica count needs to restore the checkpoint (StateForm.restore_target). `every` and the
    outer settings are those of local SGD and DiLoCo (as ReplicaSyncConfig.describe gives them),
    None where replicas step together; `replicas`: the mesh's replica count."""

    mode: str = "every_step"
    every: int | None = None
    outer_learning_rate: float | None = None
    outer_momentum: float | None = None
    replicas: int | None = None

    @classmethod
    def of(cls, sync: ReplicaSyncConfig, replicas: int) -> SavedSync:
        return cls(**sync.describe(), replicas=replicas)

    @property
    def replicas_apart(self) -> int | None:
        """How many replicas held a state of their own (local SGD, DiLoCo); None: one state."""
        return None if self.mode == "every_step" else self.replicas

    @property
    def period(self) -> int:
        """H: steps between synchronisations (1: every step)."""
        return self.every or 1

    def config(self) -> ReplicaSyncConfig:
        """The synchronisation as saved, for its outer optimizer (local SGD, DiLoCo)."""
        return ReplicaSyncConfig(
            mode=self.mode, every=self.period, outer_learning_rate=self.outer_learning_rate,
            outer_momentum=self.outer_momentum,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointMeta(JsonRecord):
    """A checkpoint's meta. `run` is the run that wrote it, as a value (None in checkpoints
    written before it was kept: theirs held the operative gin config as text, `gin`, which
    export reads through the CLI). The other fields say what a restore checks and needs
    without the run: every checkpoint has them, so old and new ones are read alike."""

    step: int
    data_position: int = 0  # batches the data stream has given
    seed: int | None = None
    model: dict[str, int]  # model_signature: checked against the restoring run's model
    optimizer: str  # OptimizerConfig.name: the optimizer state's structure
    precision: str | None = None  # of the run that saved (the state is fp32 either way)
    sync: SavedSync = SavedSync()
    run: RunConfig | None = None
    gin: str | None = None  # old checkpoints only

    @classmethod
    def read(cls, data: Any, where: str) -> CheckpointMeta:
        """The meta from its JSON; a ConfigError naming `where` if that is no checkpoint's
        meta (a run's configuration this version of t5scale refuses, a field missing)."""
        try:
            return cls.from_json(data)
        except (TypeError, ValueError, AttributeError) as error:
            raise ConfigError(f"{where} has a meta this t5scale cannot read: {error}") from None


def check_compatible(meta: CheckpointMeta, model: ModelConfig, optimizer: str, where: str) -> None:
    """One ConfigError naming the first field where the checkpoint and this run differ."""
    for name, value in model_signature(model).items():
        if meta.model.get(name) != value:
            raise ConfigError(
                f"{where} was written for a different model: {name} is {meta.model.get(name)} "
                f"there and {value} in this run"
            )
    if meta.optimizer != optimizer:
        raise ConfigError(
            f"{where} was written with optimizer {meta.optimizer!r}, this run uses {optimizer!r}"
        )
