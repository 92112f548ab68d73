"""gin at the edge, in t5x's conventions: --gin_file, --gin.NAME=VALUE, --gin_search_paths.

gin binds only the frozen config dataclasses; everything past `build_run_config` takes plain
arguments, so the Python API needs no gin at all.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import gin
from t5scale.data.config import DataConfig
from t5scale.errors import ConfigError
from t5scale.model.sizes import RENAMED_REMATS, ModelConfig
from t5scale.parallel.distributed import DistributedConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.study.config import StudyConfig
from t5scale.train.config import CheckpointConfig, RunConfig, TrainConfig
from t5scale.train.optim import OptimizerConfig
from t5scale.train.precision import PrecisionConfig
from t5scale.train.replicas import ReplicaSyncConfig
from t5scale.whatif.gpu_cluster import ClusterConfig
from t5scale.whatif.hardware import Hardware
from t5scale.whatif.plan import PlanConfig
from t5scale.whatif.simulate import SimulateConfig
from t5scale.whatif.tpu_pod import TpuPodConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
# Always parsed first: it declares the macros (TRAIN_STEPS, MODEL_DIR, …) that runs override.
BASE_GIN = "gin/runs/base.gin"

_CONFIGURABLES = {
    "model": gin.external_configurable(ModelConfig, "ModelConfig"),
    "parallel": gin.external_configurable(ParallelConfig, "ParallelConfig"),
    "optimizer": gin.external_configurable(OptimizerConfig, "OptimizerConfig"),
    "train": gin.external_configurable(TrainConfig, "TrainConfig"),
    "data": gin.external_configurable(DataConfig, "DataConfig"),
    "checkpoint": gin.external_configurable(CheckpointConfig, "CheckpointConfig"),
    "distributed": gin.external_configurable(DistributedConfig, "DistributedConfig"),
    "precision": gin.external_configurable(PrecisionConfig, "PrecisionConfig"),
    "sync": gin.external_configurable(ReplicaSyncConfig, "ReplicaSyncConfig"),
}
_STUDY_CONFIGURABLES = {
    "study": gin.external_configurable(StudyConfig, "StudyConfig"),
    "plan": gin.external_configurable(PlanConfig, "PlanConfig"),
    "cluster": gin.external_configurable(ClusterConfig, "ClusterConfig"),
    "tpu_pod": gin.external_configurable(TpuPodConfig, "TpuPodConfig"),
    "simulate": gin.external_configurable(SimulateConfig, "SimulateConfig"),
}


def default_search_paths() -> list[str]:
    return list(dict.fromkeys([os.getcwd(), str(REPO_ROOT), str(REPO_ROOT / "gin")]))


def _binding(flag: str) -> str:
    """`NAME=VALUE` as a gin binding; a bare path or word becomes a string (t5x needs quotes)."""
    name, equals, value = flag.partition("=")
    if not equals:
        raise ConfigError(f"--gin.{flag}: expected --gin.NAME=VALUE")
    if value.startswith(("@", "%")):  # a gin reference or macro
        return f"{name} = {value}"
    try:
        ast.literal_eval(value)
        return f"{name} = {value}"
    except (ValueError, SyntaxError):
        return f"{name} = {value!r}"


def parse_gin(
    gin_files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str] = ()
) -> None:
    """Parse the base file, then `gin_files` in order, then `bindings` (NAME=VALUE strings)."""
    gin.clear_config()
    for path in dict.fromkeys([*search_paths, *default_search_paths()]):
        gin.add_config_file_search_path(path)
    root_logger = logging.getLogger()
    level = root_logger.level
    root_logger.setLevel(logging.CRITICAL)  # gin logs every search path it misses
    try:
        gin.parse_config_files_and_bindings(
            [BASE_GIN, *gin_files], [_binding(b) for b in bindings], finalize_config=False
        )
    except OSError as error:
        raise ConfigError(f"gin file not found: {str(error).splitlines()[0]}") from None
    except (ValueError, SyntaxError) as error:
        raise ConfigError(_gin_syntax_error(error)) from None
    finally:
        root_logger.setLevel(level)
    check_macros_read()


# gin's error for a bare word as a value: Python's ast error, which names an object's address,
# then gin's own words and where: "malformed node or string on line 1: <ast.Name object at
# 0x7f…> Failed to parse token 'dots' (quick.gin, line 3)"
_BARE_WORD = re.compile(r"Failed to parse token '(?P<token>[^']*)'(?: \((?P<where>[^()]*)\))?")


def _gin_syntax_error(error: Exception) -> str:
    """gin's parse error in one line; a bare word, the commonest, said as what to write."""
    text = " ".join(str(error).split())
    bare = _BARE_WORD.search(text)
    if bare is None:
        return f"gin: {text}"
    token, where = bare["token"], f" ({bare['where']})" if bare["where"] else ""
    return (
        f"gin: {token} is not a value{where}: a string needs quotes ('{token}'), a "
        f"configurable an @ (@{token}), a macro a % (%{token})"
    )


def check_macros_read() -> None:
    """A macro that no binding reads is an error: gin takes any unknown upper-case name as a
    new macro, so `--gin.TRAIN_STEP=100` (S missing) would otherwise train the default steps.
    The shipped files' own macros are exempt: a run may bind the parameter that reads one
    directly (`--gin.StudyConfig.study_dir=…` leaves STUDY_DIR unread)."""
    # gin has no public list of what is bound: its own (private) table of bindings is read.
    bound = {scope for scope, selector in gin.config._CONFIG if selector == "gin.macro"}
    read = {
        reference.scoped_selector.split("/")[0]
        for reference in gin.config.iterate_references(gin.config._CONFIG)
        if reference.selector == "gin.macro"
    }
    undefined = sorted(read - bound)  # gin would call the macro with no value, much later
    if undefined:
        raise ConfigError(
            f"gin: macro {undefined[0]} is not defined (bind it: --gin.{undefined[0]}=…)"
        )
    shipped = shipped_macros()
    unread = sorted(bound - read - shipped)
    if unread:
        name = unread[0]
        near = difflib.get_close_matches(name, sorted(read | shipped), n=1, cutoff=0.5)
        hint = f"; did you mean {near[0]}?" if near else f"; the macros read are {sorted(read)}"
        raise ConfigError(f"gin: the macro {name} is bound but no configuration reads it{hint}")


@functools.cache
def shipped_macros() -> frozenset[str]:
    """The macros the repository's gin files define (`NAME = value` at the start of a line)."""
    names = set()
    for path in (REPO_ROOT / "gin").rglob("*.gin"):
        names.update(re.findall(r"^([A-Z][A-Z0-9_]*)\s*=", path.read_text(), re.MULTILINE))
    return frozenset(names)


def build_study_config(name: str = "study"):
    """The StudyConfig ('study'), PlanConfig ('plan') … that the parsed gin files describe."""
    return _build(_STUDY_CONFIGURABLES[name])


def build_hardware(required: bool = False) -> Hardware | None:
    """The hardware a cluster file (gin/clusters/) binds, a GPU cluster (ClusterConfig) or a
    TPU pod (TpuPodConfig), or None where none is given; a ConfigError naming the figures not
    given where one is `required` or partly given."""
    given = []
    for name, kind in (("cluster", ClusterConfig), ("tpu_pod", TpuPodConfig)):
        needed = [f.name for f in dataclasses.fields(kind) if f.default is dataclasses.MISSING]
        missing = [field for field in needed if not _bound(f"{kind.__name__}.{field}")]
        if missing == needed:
            continue
        if missing:
            raise ConfigError(
                f"{kind.__name__}: not given: {', '.join(missing)}; a cluster file names every "
                "figure, e.g. --gin_file=gin/clusters/a100.gin or gin/clusters/tpu_v5p.gin"
            )
        given.append((name, kind))
    if len(given) > 1:  # one would be dropped without a word
        raise ConfigError(
            "both a GPU cluster (ClusterConfig) and a TPU pod (TpuPodConfig) are given: "
            "give one cluster file of gin/clusters/"
        )
    if given:
        return build_study_config(given[0][0])
    if required:
        raise ConfigError(
            "no cluster file: give one of gin/clusters/ (a GPU cluster or a TPU pod), e.g. "
            "--gin_file=gin/clusters/h100.gin"
        )
    return None


def _bound(parameter: str) -> bool:
    try:
        gin.query_parameter(parameter)
    except ValueError:
        return False
    return True


def study_runs(study: StudyConfig) -> dict[str, RunConfig]:
    """Each model's run before a grid point is applied to it (study/config.py, Point.run): its
    gin/models/<name>.gin and the study's extra bindings, over gin/runs/base.gin. The trials
    get their runs as values; gin is read here, once per model."""
    runs = {}
    for model in study.models:
        parse_gin([f"gin/models/{model}.gin"], study.extra_bindings)
        runs[model] = build_run_config()
    return runs


def build_run_config() -> RunConfig:
    """The RunConfig the parsed gin files describe; bad values become one-line ConfigErrors."""
    return _build(lambda: RunConfig(**{field: make() for field, make in _CONFIGURABLES.items()}))


# An operative config's remat binding by an earlier name, as old checkpoints' metas hold it
_OLD_REMAT = re.compile(
    rf"^(\s*ModelConfig\.remat\s*=\s*)(['\"])({'|'.join(RENAMED_REMATS)})\2", re.MULTILINE
)


def run_from_gin_text(text: str) -> RunConfig:
    """The RunConfig an operative gin config describes: how checkpoints written before the run
    was kept as JSON in their meta name it (t5scale/train/export.py reads both). A remat
    policy by an earlier name reads as it is named now (the operative config binds it)."""
    text = _OLD_REMAT.sub(lambda m: m[1] + repr(RENAMED_REMATS[m[3]]), text)
    with tempfile.NamedTemporaryFile("w", suffix=".gin", encoding="utf-8") as written:
        written.write(text)
        written.flush()
        parse_gin([written.name], [])
    return build_run_config()


def _build(make):
    try:
        return make()
    except (ValueError, TypeError) as error:
        # gin appends "In call to configurable …" on later lines; the first line is the reason.
        raise ConfigError(str(error).splitlines()[0]) from None


def gin_text_of(*configs: object) -> str:
    """Configs as gin bindings a person can read and pass back with --gin_file, e.g. the
    ModelConfig and PrecisionConfig `t5scale convert` writes to MODEL_DIR/model.gin."""
    return "".join(
        f"{type(config).__name__}.{name} = {value!r}\n"
        for config in configs
        for name, value in dataclasses.asdict(config).items()
    )


def operative_config() -> str:
    return gin.operative_config_str()
