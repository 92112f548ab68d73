"""What a study sweeps (StudyConfig, bound by gin/study/*.gin) and one point of its grid."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

from t5scale.analysis.jsonform import fields_from_json
from t5scale.errors import ConfigError
from t5scale.model.sizes import REMAT_LADDER
from t5scale.parallel.zero import check_stages
from t5scale.study.weak_scaling import WeakScaling
from t5scale.train.replicas import MODES, ReplicaSyncConfig

OBJECTIVES = ("tokens_per_s_per_device", "loss")
# Point fields by an earlier name, as results.jsonl's older lines hold them
RENAMED_POINT_FIELDS = {"gradient_accumulation": "micro_batches"}
SEARCHES = ("funnel", "grid")


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """The grid (every axis a list), how each trial runs, and how the funnel prunes.

    The batch is weak-scaled (t5scale/study/weak_scaling.py): micro_batch_size per data-parallel
    device, micro_batches of them accumulated per step.
    search: 'funnel' (at each device count, smallest first, compile and drop what does not
    fit, then time and drop what is worse than its model's best with the stated confidence:
    t5scale/study/funnel.py) or 'grid' (every point timed).
    Timing (t5scale/study/evidence.py): steps run until the median step time's `confidence`
    interval is within ±timing_precision of it, or max_timed_steps or max_timing_s are spent;
    the warm-up steps are found in the timings, not assumed.
    objective: 'tokens_per_s_per_device' (higher wins) or 'loss' (the loss after
    `token_budget` tokens, lower wins; for learning-rate and batch-size choices).
    device_memory_gb: the per-device budget; None → the GPU's own limit, or on the CPU this
    machine's memory shared by the emulated devices.
    replica_syncs: how replicas synchronise, each 'every_step' (ZeRO over every device, as
    DeepSpeed) or 'local_sgd/H' or 'diloco/H' (`replicas` replicas, ZeRO inside each, an outer
    step every H steps: t5scale/train/replicas.py). Compare them with the `loss` objective after
    a token budget, so that a faster configuration that learns worse does not win on speed.
    """

    study_dir: str = "runs/study"
    models: tuple[str, ...] = ("mt5_tiny",)
    stages: tuple[int, ...] = (0, 1, 2, 3)
    devices: tuple[int, ...] = (1, 2, 4, 8)
    micro_batch_sizes: tuple[int, ...] = (1,)
    remats: tuple[str, ...] = ("none",)
    learning_rates: tuple[float, ...] = (1e-3,)
    replica_syncs: tuple[str, ...] = ("every_step",)
    replicas: int = 2
    tensor: int = 1
    micro_batches: int = 1
    input_length: int = 128
    target_length: int = 32
    dtype: str = "float32"
    precision: str = "auto"  # PrecisionConfig.mode: auto (mixed when dtype is bfloat16), ...
    optimizer: str = "adamw"
    data_source: str = "synthetic"
    timing_precision: float = 0.05  # at 95%: each trial's own interval (evidence.py)
    # The funnel keeps the truly best configuration with this probability (docs/funnel.md).
    confidence: float = 0.99
    # Trials per configuration and round, each a process of its own: with 2 or more the
    # evidence includes how much a trial's process moves its median (docs/funnel.md).
    repeats: int = 2
    max_timed_steps: int = 100
    max_timing_s: float = 30.0
    token_budget: int = 0
    search: str = "funnel"
    objective: str = "tokens_per_s_per_device"
    device_memory_gb: float | None = None
    trial_timeout_s: float = 300.0
    compile_workers: int = 0  # parallel compile-only trials; 0: one per CPU core
    # Several hosts: a trial with more devices than `devices_per_host` runs under this launcher
    # (one process per host), e.g. 'srun --nodes={hosts} --ntasks-per-node=1 --kill-on-bad-exit'
    # inside a SLURM allocation; {hosts} and {devices} are filled in. Empty: one process.
    trial_launcher: str = ""
    devices_per_host: int = 8
    extra_bindings: tuple[str, ...] = ()  # NAME=VALUE gin bindings for every trial
    # After the search: a jax.profiler trace of 3 steps of each model's winner, in
    # STUDY_DIR/profile (TensorBoard's profile plugin, or ui.perfetto.dev).
    profile_winner: bool = False

    def __post_init__(self) -> None:
        for field in ("models", "stages", "devices", "micro_batch_sizes", "remats",
                      "learning_rates", "replica_syncs", "extra_bindings"):  # fmt: skip
            object.__setattr__(self, field, tuple(getattr(self, field)))  # gin gives lists
        for axis in (
            "models",
            "stages",
            "devices",
            "micro_batch_sizes",
            "remats",
            "learning_rates",
            "replica_syncs",
        ):
            if not getattr(self, axis):
                raise ConfigError(f"StudyConfig.{axis} is empty")
        for sync in self.replica_syncs:
            replica_sync(sync)  # a ConfigError naming it
        if self.replicas < 1:
            raise ConfigError("StudyConfig.replicas must be >= 1")
        check_stages(self.stages, "StudyConfig.stages")
        if bad := [d for d in self.devices if d < 1 or d % self.tensor]:
            raise ConfigError(
                f"StudyConfig.devices {bad}: each must be a positive multiple of tensor={self.tensor}"
            )
        if bad := [r for r in self.remats if r not in (*REMAT_LADDER, "auto")]:
            raise ConfigError(
                f"StudyConfig.remats {bad}: each must be one of {', '.join(REMAT_LADDER)} or auto"
            )
        if self.search not in SEARCHES:
            raise ConfigError(f"StudyConfig.search must be one of {SEARCHES}, got {self.search!r}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                f"StudyConfig.objective must be one of {OBJECTIVES}, got {self.objective!r}"
            )
        if self.objective == "loss" and self.token_budget <= 0:
            raise ConfigError("StudyConfig.objective='loss' needs a token_budget > 0")
        if not (0 < self.timing_precision < 1 and 0.5 < self.confidence < 1):
            raise ConfigError(
                "StudyConfig.timing_precision must be in (0, 1) and confidence in (0.5, 1)"
            )
        if self.devices_per_host < 1:
            raise ConfigError("StudyConfig.devices_per_host must be >= 1")
        if self.trial_launcher and any(
            d > self.devices_per_host and d % self.devices_per_host for d in self.devices
        ):
            raise ConfigError(
                f"StudyConfig.devices: counts above devices_per_host={self.devices_per_host} "
                "must be whole hosts"
            )
        if self.repeats < 1:
            raise ConfigError("StudyConfig.repeats must be >= 1")
        if self.max_timed_steps < 1 or self.max_timing_s <= 0 or self.trial_timeout_s <= 0:
            raise ConfigError("StudyConfig: max_timed_steps >= 1, max_timing_s > 0 and "
                              "trial_timeout_s > 0")  # fmt: skip

    def configurations(self) -> list[Configuration]:
        """Every configuration of the grid, device count aside (the funnel's unit)."""
        axes = (self.models, self.stages, self.micro_batch_sizes, self.remats, self.learning_rates,
                self.replica_syncs)  # fmt: skip
        return [Configuration(*values) for values in itertools.product(*axes)]

    def point(self, configuration: Configuration, devices: int) -> Point:
        """The configuration on `devices`, with this study's settings for every trial."""
        shared = {f.name for f in dataclasses.fields(Point)} - {"devices"}
        settings = {name: getattr(self, name) for name in shared if hasattr(self, name)}
        return Point(**dataclasses.asdict(configuration), devices=devices, **settings)


@dataclasses.dataclass(frozen=True, order=True)
class Configuration:
    """What the funnel keeps or drops: a grid point without its device count."""

    model: str
    stage: int
    micro_batch_size: int
    remat: str
    learning_rate: float
    sync: str = "every_step"

    def label(self) -> str:
        sync = "" if self.sync == "every_step" else f" {self.sync}"
        return (
            f"{self.model} stage {self.stage} mb {self.micro_batch_size} remat {self.remat}"
            f" lr {self.learning_rate:g}{sync}"
        )


def replica_sync(text: str) -> ReplicaSyncConfig:
    """'every_step', 'local_sgd/H' or 'diloco/H' as a ReplicaSyncConfig (other settings at
    their defaults); a ConfigError otherwise."""
    mode, _, every = text.partition("/")
    if mode not in MODES or (mode == "every_step") != (not every) or not (every or "1").isdigit():
        raise ConfigError(
            f"StudyConfig.replica_syncs: {text!r} is not 'every_step', 'local_sgd/H' or 'diloco/H'"
        )
    return ReplicaSyncConfig(mode, int(every or 1))


@dataclasses.dataclass(frozen=True)
class Point:
    """One trial's full configuration: everything that decides what the step is."""

    model: str
    stage: int
    micro_batch_size: int
    remat: str
    learning_rate: float
    devices: int
    sync: str = "every_step"
    replicas: int = 2  # for local SGD and DiLoCo
    tensor: int = 1
    micro_batches: int = 1
    input_length: int = 128
    target_length: int = 32
    dtype: str = "float32"
    precision: str = "auto"
    optimizer: str = "adamw"
    data_source: str = "synthetic"

    @property
    def configuration(self) -> Configuration:
        return Configuration(*(getattr(self, f.name) for f in dataclasses.fields(Configuration)))

    @property
    def scaling(self) -> WeakScaling:
        """The stage, mesh and batch: ZeRO over every device synchronised every step, as
        DeepSpeed, or inside each of `replicas` replicas."""
        replicas = 1 if self.sync == "every_step" else self.replicas
        return WeakScaling(self.stage, self.devices, self.micro_batch_size, self.micro_batches,
                           self.tensor, replicas)  # fmt: skip

    @property
    def batch_size(self) -> int:
        return self.scaling.batch_size

    def gin_files(self) -> list[str]:
        return [f"gin/models/{self.model}.gin"]

    def _replication(self) -> list[str]:
        if self.sync == "every_step":
            return ["ParallelConfig.zero_across_hosts=True"]
        sync = replica_sync(self.sync)
        return [  # a replica per host where there are several: ZeRO inside each
            "ParallelConfig.zero_across_hosts=False",
            f"ReplicaSyncConfig.mode='{sync.mode}'",
            f"ReplicaSyncConfig.every={sync.every}",
        ]

    def gin_bindings(self) -> list[str]:
        """The run this point is, as --gin.NAME=VALUE bindings over its model's gin file."""
        return [
            *self.scaling.gin_bindings(),
            *self._replication(),
            f"ModelConfig.remat='{self.remat}'",
            f"ModelConfig.dtype='{self.dtype}'",
            f"PrecisionConfig.mode='{self.precision}'",
            f"OptimizerConfig.name='{self.optimizer}'",
            f"OptimizerConfig.learning_rate={self.learning_rate!r}",
            f"INPUT_LENGTH={self.input_length}",
            f"TARGET_LENGTH={self.target_length}",
            f"DATA_SOURCE='{self.data_source}'",
        ]

    def run_name(self) -> str:
        """A path that names the point, e.g. mt5_tiny/stage2_mb1_none_lr0.001/4dev."""
        sync = "" if self.sync == "every_step" else "_" + self.sync.replace("/", "")
        return (
            f"{self.model}/stage{self.stage}_mb{self.micro_batch_size}_{self.remat}"
            f"_lr{self.learning_rate:g}{sync}/{self.devices}dev"
        )

    def key(self, kind: str) -> str:
        """Identifies a finished trial in results.jsonl, so a restarted study skips it."""
        fields = ",".join(f"{k}={v}" for k, v in sorted(dataclasses.asdict(self).items()))
        return f"{kind}:{fields}"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"batch_size": self.batch_size}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Point:
        """A point from its JSON form (`as_dict`'s or the fields'): a field a study before it
        lacks takes its default, and a field by an earlier name is read as it is now named."""
        return fields_from_json(cls, {RENAMED_POINT_FIELDS.get(k, k): v for k, v in data.items()})
