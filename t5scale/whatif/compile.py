"""The one place a run is compiled for a plan, a simulation or a study's trial.

    target = hardware.target(16)                      # or Target.local(8): emulated devices
    step = compile_for(weak_scale(run, 3, 16, 4, dcn_groups=target.dcn_groups), target, budget)
    analysis = cached_analysis(run, target, budget)  # the same, kept on disk

`compile_for` lays the run over the target's devices and compiles its step with nothing
allocated; `cached_analysis` keeps each compiled step's analysis on disk, keyed by the whole
run and the target, since compiling a large model for 64 devices takes tens of seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Literal

import jax

from t5scale.analysis.records import StepAnalysis
from t5scale.analysis.step import with_every
from t5scale.errors import ConfigError
from t5scale.target import Target
from t5scale.train.config import RunConfig
from t5scale.train.setup import CompiledStep, build_setup

Compiler = Literal["auto", "gpu", "cpu"]


class ModelStateTooLarge(ValueError):
    """The ZeRO formula's model state alone exceeds the memory budget: no need to compile."""

    def __init__(self, state_bytes: float, budget_bytes: int):
        self.state_bytes, self.budget_bytes = state_bytes, budget_bytes
        super().__init__(
            f"the ZeRO formula's model state alone, {state_bytes / 2**30:.2f} GiB per device, "
            f"exceeds the budget {budget_bytes / 2**30:.2f} GiB"
        )


def compile_for(
    run: RunConfig,
    target: Target,
    memory_budget_bytes: int | None = None,
    refuse_above_budget: bool = False,
) -> CompiledStep:
    """`run`'s one-step program compiled for `target` (nothing allocated); remat 'auto' chosen
    within `memory_budget_bytes`. With `refuse_above_budget`, a ModelStateTooLarge before any
    compile where the ZeRO formula alone exceeds the budget (a lower bound of the step's
    memory, known from the shapes)."""
    setup = build_setup(run, target)
    if refuse_above_budget and memory_budget_bytes is not None:
        form = setup.form
        state = form.model_state_bytes().per_device(form.layout.stage, form.layout.zero_size)
        if state.total > memory_budget_bytes:
            raise ModelStateTooLarge(state.total, memory_budget_bytes)
    return setup.compile(memory_budget_bytes=memory_budget_bytes)


_CACHE_WRITE = threading.Lock()
# The code that makes a step's program or reads it, by its path in the package: its bytes are
# part of the key, so that no analysis of a program the code no longer makes is served (the head's
# products and the gated GELU's gradient changed every GPU program of the twenty-first session
# and no run field), nor one in an older step_analysis.json layout (analysis/records.py; a
# version number bumped by hand did this before). The cluster model's pricing (whatif/, but this
# file) is not among them: refitting it reuses every compiled program.
PROGRAM_CODE = ("model", "train", "parallel", "analysis", "data/batch.py", "jsonform.py",
                "target.py", "xla_cpu.py", "xla_gpu.py", "xla_tpu.py", "whatif/compile.py")  # fmt: skip
PACKAGE = Path(__file__).resolve().parents[1]


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root, "t5scale", "step_analyses.json")


# Where the data's files are shapes no program: a cache filled in one checkout serves another.
_DATA_FILES = ("corpus_dir", "vocabulary", "tfds_data_dir")


@functools.cache
def program_code_digest(package: Path = PACKAGE) -> str:
    """A digest of PROGRAM_CODE's files under `package`: their paths within it and their bytes,
    so that two checkouts of the same code share it."""
    digest = hashlib.sha256()
    for entry in PROGRAM_CODE:
        path = package / entry
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(package).as_posix().encode() + b"\0")
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def analysis_key(run: RunConfig, target: Target, memory_budget_bytes: int | None = None) -> str:
    """The analysis cache's key: the whole run, but for what does not change its program (local
    SGD's or DiLoCo's H, which only divides the outer step's cost, so one compile serves every
    H; the data's file paths), the target, the budget, the JAX version and the code that makes
    the program (program_code_digest)."""
    keyed = run.to_json()
    keyed["sync"]["every"] = 1
    for field in _DATA_FILES:
        keyed["data"].pop(field, None)
    key_text = json.dumps(
        [keyed, target.compiler_name, target.size, jax.__version__, memory_budget_bytes,
         program_code_digest()], sort_keys=True, default=str,
    )  # fmt: skip
    return hashlib.sha256(key_text.encode()).hexdigest()[:24]


def cached_analysis(
    run: RunConfig, target: Target, memory_budget_bytes: int | None = None
) -> StepAnalysis:
    """`compile_for(run, target, memory_budget_bytes).analysis`, kept on disk under
    `analysis_key`."""
    key = analysis_key(run, target, memory_budget_bytes)
    path = _cache_path()
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key in cache:
        return with_every(StepAnalysis.from_json(cache[key]), run.sync.every)
    analysis = compile_for(run, target, memory_budget_bytes).analysis
    with _CACHE_WRITE:  # threads of one process (bench/seed_study_predicted.py) add in turn
        cache = json.loads(path.read_text()) if path.exists() else {}
        cache[key] = analysis.to_json()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(path)
    return analysis


# How XLA says it refused a program for memory (XLA:TPU: "RESOURCE_EXHAUSTED: Allocation
# (size=…) would exceed memory (size=…)", even when told not to crash on one: a single buffer
# larger than the chip's HBM).
MEMORY_REFUSALS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")
_ALLOCATION = re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)")


@dataclasses.dataclass(frozen=True)
class DoesNotFit:
    """A program the compiler refused for memory, in the compiler's own figures."""

    said: str  # the compiler's reason, one line

    @property
    def words(self) -> str:
        """'XLA refused it: a 65.6 GB buffer, the device has 17.2 GB'."""
        found = _ALLOCATION.search(self.said)
        if found is None:
            return f"XLA refused it: {self.said}"
        wanted, memory = (int(size) / 1e9 for size in found.groups())
        return f"XLA refused it: a {wanted:.3g} GB buffer, the device has {memory:.3g} GB"


def is_memory_refusal(error: BaseException) -> bool:
    return any(marker in str(error) for marker in MEMORY_REFUSALS)


def refusal_of(error: BaseException, what: str) -> DoesNotFit:
    """DoesNotFit where XLA refused `what` for memory; any other compiler failure a
    ConfigError of one line (`what` and the compiler's first line)."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    if is_memory_refusal(error):
        return DoesNotFit(first[:300])
    raise ConfigError(f"{what}: the compiler failed: {type(error).__name__}: {first[:300]}")


def analysis_or_refusal(
    run: RunConfig, target: Target, memory_budget_bytes: int | None, what: str
) -> StepAnalysis | DoesNotFit:
    """cached_analysis, or DoesNotFit where XLA refused the program for memory (a point that
    `simulate` and the study report and pass); a ConfigError for any other compiler failure."""
    try:
        return cached_analysis(run, target, memory_budget_bytes)
    except jax.errors.JaxRuntimeError as error:
        return refusal_of(error, what)
