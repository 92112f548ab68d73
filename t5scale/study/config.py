"""What a study sweeps (StudyConfig, bound by gin/study/*.gin) and one point of its grid."""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, get_args

from t5scale.data.config import DataConfig
from t5scale.errors import ConfigError, check_field_types
from t5scale.jsonform import fields_from_json
from t5scale.model.sizes import REMAT_LADDER, RENAMED_REMATS, SIZES, DType, ModelConfig
from t5scale.parallel.zero import check_stages, with_pipeline
from t5scale.train.config import RunConfig
from t5scale.train.optim import OptimizerConfig
from t5scale.train.precision import PrecisionConfig, resolve
from t5scale.train.replicas import MODES, ReplicaSyncConfig
from t5scale.whatif.weak_scaling import weak_scale

REPO_ROOT = Path(__file__).resolve().parents[2]

OBJECTIVES = ("tokens_per_s_per_device", "loss")
# Point fields by an earlier name, as results.jsonl's older lines hold them
RENAMED_POINT_FIELDS = {"gradient_accumulation": "micro_batches"}
# Point values by an earlier name, by field: read as the value is named now
RENAMED_POINT_VALUES = {"remat": RENAMED_REMATS}
SEARCHES = ("funnel", "grid")


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """The grid (every axis a list), how each trial runs, and how the funnel prunes.

    The batch is weak-scaled (t5scale/whatif/weak_scaling.py): micro_batch_size per data-parallel
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
    remats: tuple[str, ...] = ("dots",)
    learning_rates: tuple[float, ...] = (1e-3,)
    replica_syncs: tuple[str, ...] = ("every_step",)
    # Pipeline degrees (t5scale/train/pipeline.py): each with stages 0 and 1 only, on the
    # device counts that tensor × pipeline divides; micro_batches must be a multiple of each.
    pipelines: tuple[int, ...] = (1,)
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
        check_field_types(self)  # first: a bare word would otherwise split into characters
        for field in ("models", "stages", "devices", "micro_batch_sizes", "remats",
                      "learning_rates", "replica_syncs", "pipelines", "extra_bindings"):  # fmt: skip
            object.__setattr__(self, field, tuple(getattr(self, field)))  # gin gives lists
        self._check_grid()
        self._check_trial_settings()
        self._check_search()
        self._check_hosts()

    def _check_grid(self) -> None:
        """Every axis non-empty and each value one a trial can run."""
        for axis in ("models", "stages", "devices", "micro_batch_sizes", "remats",
                     "learning_rates", "replica_syncs", "pipelines"):  # fmt: skip
            if not getattr(self, axis):
                raise ConfigError(f"StudyConfig.{axis} is empty")
        if bad := [p for p in self.pipelines if p < 1 or self.micro_batches % p]:
            raise ConfigError(
                f"StudyConfig.pipelines {bad}: each must be >= 1 and divide "
                f"micro_batches={self.micro_batches} (a pipeline's micro-batches)"
            )
        if max(self.pipelines) > 1 and not with_pipeline(self.stages, max(self.pipelines)):
            raise ConfigError("StudyConfig.pipelines: a pipeline takes ZeRO stages 0 and 1, and "
                              f"StudyConfig.stages has only {list(self.stages)}")  # fmt: skip
        if bad := [m for m in self.models if not _is_model(m)]:
            raise ConfigError(
                f"StudyConfig.models {bad}: each must be a size ({', '.join(SIZES)}) or have "
                "its gin/models/<name>.gin"
            )
        for sync in self.replica_syncs:
            replica_sync(sync)  # a ConfigError naming it
        _reraise("StudyConfig.stages", lambda: check_stages(self.stages, "StudyConfig.stages"))
        if self.tensor < 1:  # before `%` below
            raise ConfigError(f"StudyConfig.tensor must be >= 1, got {self.tensor}")
        if bad := [d for d in self.devices if d < 1 or d % self.tensor]:
            raise ConfigError(
                f"StudyConfig.devices {bad}: each must be a positive multiple of tensor={self.tensor}"
            )
        if self.tensor > 1 and (bad := [d for d in self.devices if d == self.tensor]):
            raise ConfigError(  # a mesh of tensor alone does not compile: t5scale/parallel/mesh.py
                f"StudyConfig.devices {bad}: with tensor={self.tensor} each must be at least "
                f"{2 * self.tensor}, so that some devices split the batch"
            )
        if bad := [m for m in self.micro_batch_sizes if m < 1]:
            raise ConfigError(f"StudyConfig.micro_batch_sizes {bad}: each must be >= 1")
        if renamed := [r for r in self.remats if r in RENAMED_REMATS]:  # say what it is now
            _reraise("StudyConfig.remats", lambda: ModelConfig("mt5_tiny", remat=renamed[0]))
        if bad := [
            r for r in self.remats if _refused(lambda r=r: ModelConfig("mt5_tiny", remat=r))
        ]:
            raise ConfigError(
                f"StudyConfig.remats {bad}: each must be one of {', '.join(REMAT_LADDER)} or auto"
            )
        if bad := [rate for rate in self.learning_rates if not rate > 0]:
            raise ConfigError(f"StudyConfig.learning_rates {bad}: each must be > 0")

    def _check_trial_settings(self) -> None:
        """What every trial shares, by the validators its run applies (so that no trial of the
        grid fails on them one by one)."""
        if self.replicas < 1:
            raise ConfigError(f"StudyConfig.replicas must be >= 1, got {self.replicas}")
        if self.micro_batches < 1:
            raise ConfigError(f"StudyConfig.micro_batches must be >= 1, got {self.micro_batches}")
        if self.input_length < 2 or self.target_length < 2:
            raise ConfigError(
                "StudyConfig.input_length and target_length must be >= 2, got "
                f"{self.input_length} and {self.target_length}"
            )
        if _refused(lambda: ModelConfig("mt5_tiny", dtype=self.dtype)):
            raise ConfigError(
                f"StudyConfig.dtype must be one of {', '.join(get_args(DType))}, got {self.dtype!r}"
            )
        _reraise("StudyConfig.precision", lambda: PrecisionConfig(mode=self.precision))
        _reraise(  # mixed and fp8 compute in bf16
            "StudyConfig.precision",
            lambda: resolve(PrecisionConfig(mode=self.precision), self.dtype),
        )
        _reraise("StudyConfig.optimizer", lambda: OptimizerConfig(name=self.optimizer))
        _reraise("StudyConfig.data_source", lambda: DataConfig(source=self.data_source))
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            raise ConfigError(
                f"StudyConfig.device_memory_gb must be None or > 0, got {self.device_memory_gb}"
            )
        if self.compile_workers < 0:
            raise ConfigError(
                f"StudyConfig.compile_workers must be >= 0 (0: one per core), got "
                f"{self.compile_workers}"
            )
        if bad := [b for b in self.extra_bindings if not _BINDING.fullmatch(b)]:
            raise ConfigError(f"StudyConfig.extra_bindings {bad}: each must be NAME=VALUE")
        for binding in self.extra_bindings:
            name = binding.partition("=")[0].strip()
            if name in GRID_SETTINGS:  # the point's own value would silently replace it
                raise ConfigError(
                    f"StudyConfig.extra_bindings: {name} is set by the grid: give it as "
                    f"StudyConfig.{GRID_SETTINGS[name]}"
                )
        if Path(self.study_dir).exists() and not Path(self.study_dir).is_dir():
            raise ConfigError(f"StudyConfig.study_dir {self.study_dir!r} is not a directory")

    def _check_search(self) -> None:
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
        if self.repeats < 1:
            raise ConfigError("StudyConfig.repeats must be >= 1")
        if self.max_timed_steps < 1 or self.max_timing_s <= 0 or self.trial_timeout_s <= 0:
            raise ConfigError("StudyConfig: max_timed_steps >= 1, max_timing_s > 0 and "
                              "trial_timeout_s > 0")  # fmt: skip

    def _check_hosts(self) -> None:
        if self.devices_per_host < 1:
            raise ConfigError("StudyConfig.devices_per_host must be >= 1")
        if not self.trial_launcher:
            return
        if any(d > self.devices_per_host and d % self.devices_per_host for d in self.devices):
            raise ConfigError(
                f"StudyConfig.devices: counts above devices_per_host={self.devices_per_host} "
                "must be whole hosts"
            )
        try:  # as the runner fills it in (runner._TrialRunner.launcher)
            words = shlex.split(self.trial_launcher.format(hosts=1, devices=1))
        except (ValueError, KeyError, IndexError) as error:
            raise ConfigError(
                f"StudyConfig.trial_launcher {self.trial_launcher!r}: {error!r} (it may name "
                "only {hosts} and {devices})"
            ) from None
        if not words or shutil.which(words[0]) is None:
            raise ConfigError(
                f"StudyConfig.trial_launcher {self.trial_launcher!r}: "
                f"{words[0] if words else 'no program'!r} is not on PATH"
            )

    def configurations(self) -> list[Configuration]:
        """Every configuration of the grid, device count aside (the funnel's unit)."""
        axes = (self.models, self.stages, self.micro_batch_sizes, self.remats, self.learning_rates,
                self.replica_syncs, self.pipelines)  # fmt: skip
        return [
            Configuration(*values)
            for values in itertools.product(*axes)
            # a pipeline with ZeRO 2 or 3 is refused (t5scale/parallel/mesh.py), as
            # DeepSpeed's is: not a point of the grid
            if with_pipeline([values[1]], values[-1])
        ]

    def point(self, configuration: Configuration, devices: int) -> Point:
        """The configuration on `devices`, with this study's settings for every trial."""
        shared = {f.name for f in dataclasses.fields(Point)} - {"devices"}
        settings = {name: getattr(self, name) for name in shared if hasattr(self, name)}
        return Point(**dataclasses.asdict(configuration), devices=devices, **settings)


_BINDING = re.compile(r"[A-Za-z_][\w.]*\s*=\s*\S.*")  # a gin NAME=VALUE
# What each trial's point sets in its run (Point.run), by the gin name an extra binding would
# use, and the StudyConfig field that sets it.
GRID_SETTINGS = {
    "ParallelConfig.zero_stage": "stages", "ParallelConfig.zero": "devices",
    "ParallelConfig.replica": "replica_syncs", "ParallelConfig.tensor": "tensor",
    "ParallelConfig.pipeline": "pipelines",
    "ParallelConfig.zero_across_hosts": "replica_syncs", "ReplicaSyncConfig.mode": "replica_syncs",
    "ReplicaSyncConfig.every": "replica_syncs", "TrainConfig.batch_size": "micro_batch_sizes",
    "BATCH_SIZE": "micro_batch_sizes", "TrainConfig.micro_batches": "micro_batches",
    "MICRO_BATCHES": "micro_batches", "ModelConfig.remat": "remats", "ModelConfig.dtype": "dtype",
    "PrecisionConfig.mode": "precision", "OptimizerConfig.name": "optimizer",
    "OptimizerConfig.learning_rate": "learning_rates", "DataConfig.input_length": "input_length",
    "INPUT_LENGTH": "input_length", "DataConfig.target_length": "target_length",
    "TARGET_LENGTH": "target_length", "DataConfig.source": "data_source",
    "DATA_SOURCE": "data_source",
}  # fmt: skip


def _is_model(name: str) -> bool:
    """A size t5scale knows, or a custom model's gin file where Point.gin_files looks."""
    return name in SIZES or Path(REPO_ROOT, "gin", "models", f"{name}.gin").is_file()


def _refused(check: Callable[[], Any]) -> bool:
    """Whether a validator of the run's configs refuses what `check` builds."""
    try:
        check()
    except ValueError:
        return True
    return False


def _reraise(where: str, check: Callable[[], Any]) -> None:
    """`check()`, a validator of the run's configs, with its ValueError a ConfigError naming
    the StudyConfig field `where` whose value it checks."""
    try:
        check()
    except ValueError as error:
        message = str(error)
        raise ConfigError(message if where in message else f"{where}: {message}") from None


@dataclasses.dataclass(frozen=True, order=True)
class Configuration:
    """What the funnel keeps or drops: a grid point without its device count."""

    model: str
    stage: int
    micro_batch_size: int
    remat: str
    learning_rate: float
    sync: str = "every_step"
    pipeline: int = 1

    def label(self) -> str:
        sync = "" if self.sync == "every_step" else f" {self.sync}"
        pipeline = f" pipeline {self.pipeline}" if self.pipeline > 1 else ""
        return (
            f"{self.model} stage {self.stage} mb {self.micro_batch_size} remat {self.remat}"
            f" lr {self.learning_rate:g}{sync}{pipeline}"
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
    pipeline: int = 1
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
    def replicas_synced_locally(self) -> int:
        """Replicas of the run: with local SGD or DiLoCo `replicas`, ZeRO inside each; else one,
        ZeRO over every device (as DeepSpeed)."""
        return 1 if self.sync == "every_step" else self.replicas

    @property
    def batch_size(self) -> int:
        data_parallel = self.devices // (self.tensor * self.pipeline)
        return self.micro_batch_size * data_parallel * self.micro_batches

    def run(self, base: RunConfig, dcn_groups: int = 1) -> RunConfig:
        """The run this point is: `base` (its model's gin file and the study's extra bindings,
        read at the edge: t5scale/config.py) at this point's stage, mesh, batch, replica sync,
        remat, precision, optimizer and data; over `dcn_groups` compile-only GPU nodes or TPU slices, laid out as
        the planner and the simulator lay it out (t5scale/whatif/weak_scaling.py)."""
        run = weak_scale(
            base, self.stage, self.devices, self.micro_batch_size,
            micro_batches=self.micro_batches, tensor=self.tensor,
            replicas=self.replicas_synced_locally, dcn_groups=dcn_groups, pipeline=self.pipeline,
        )  # fmt: skip
        # ZeRO across hosts as DeepSpeed's stages, or a replica per host with ZeRO inside each
        parallel = dataclasses.replace(run.parallel, zero_across_hosts=self.sync == "every_step")
        sync = run.sync
        if self.sync != "every_step":
            chosen = replica_sync(self.sync)
            sync = dataclasses.replace(sync, mode=chosen.mode, every=chosen.every)
        return dataclasses.replace(
            run, parallel=parallel, sync=sync,
            model=dataclasses.replace(run.model, remat=self.remat, dtype=self.dtype),
            precision=dataclasses.replace(run.precision, mode=self.precision),
            optimizer=dataclasses.replace(
                run.optimizer, name=self.optimizer, learning_rate=self.learning_rate
            ),
            data=dataclasses.replace(
                run.data, input_length=self.input_length, target_length=self.target_length,
                source=self.data_source,
            ),
        )  # fmt: skip

    def run_name(self) -> str:
        """A path that names the point, e.g. mt5_tiny/stage2_mb1_dots_lr0.001/4dev."""
        sync = "" if self.sync == "every_step" else "_" + self.sync.replace("/", "")
        pipeline = f"_pp{self.pipeline}" if self.pipeline > 1 else ""
        return (
            f"{self.model}/stage{self.stage}_mb{self.micro_batch_size}_{self.remat}"
            f"_lr{self.learning_rate:g}{sync}{pipeline}/{self.devices}dev"
        )

    def key(self, kind: str) -> str:
        """Identifies a finished trial in results.jsonl, so a restarted study skips it."""
        # pipeline=1 left out: the keys of studies from before t5scale had pipelines stay valid
        items = {k: v for k, v in dataclasses.asdict(self).items() if (k, v) != ("pipeline", 1)}
        fields = ",".join(f"{k}={v}" for k, v in sorted(items.items()))
        return f"{kind}:{fields}"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"batch_size": self.batch_size}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Point:
        """A point from its JSON form (`as_dict`'s or the fields'): a field a study before it
        lacks takes its default, and a field or value by an earlier name is read as it is now
        named."""
        fields = {RENAMED_POINT_FIELDS.get(k, k): v for k, v in data.items()}
        for field, renamed in RENAMED_POINT_VALUES.items():
            if isinstance(fields.get(field), str):
                fields[field] = renamed.get(fields[field], fields[field])
        return fields_from_json(cls, fields)

    @staticmethod
    def written_by_earlier_names(data: Mapping[str, Any]) -> bool:
        """Whether a point's JSON form names a field or value by an earlier name (its key in
        results.jsonl is then not the key the trial has now)."""
        return bool(RENAMED_POINT_FIELDS.keys() & data.keys()) or any(
            isinstance(data.get(field), str) and data[field] in renamed
            for field, renamed in RENAMED_POINT_VALUES.items()
        )
