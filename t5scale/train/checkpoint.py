"""Orbax checkpoints of a run: MODEL_DIR/checkpoints/<step>/{state, meta, fp8}.

- `state`: the TrainState (parameters, optimizer state, step), written by every process for its
  own shards and restored straight into the shardings of whatever stage and mesh the restoring
  run uses (orbax reshards), so a checkpoint moves between ZeRO stages and device counts.
- `fp8`: in fp8 precision, the FP8 matmuls' scales and amax histories (t5scale/train/fp8.py),
  an item of their own, so that a run moves between fp8 and mixed precision: a run that has
  none restores fresh ones, a run without FP8 leaves them, each said in one line.
- `meta`: JSON, a `CheckpointMeta` — the step, the data stream's position, the model's
  dimensions, the optimizer, how replicas synchronised, and the run itself (its RunConfig).

Saves are asynchronous (the arrays are copied to host memory before `save` returns, the files
are written in the background) into a temporary directory that orbax renames when complete, so
a run killed mid-save leaves the previous checkpoints as they were. On restore, a damaged latest
checkpoint is reported in one line, moved aside to checkpoints_damaged/ (never deleted) and the
previous one is tried; a checkpoint of a different model is one ConfigError naming the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from t5scale.errors import CheckpointSaveError, ConfigError
from t5scale.model.mt5 import fp8_state_like
from t5scale.model.sizes import ModelConfig
from t5scale.startup import absl_quiet
from t5scale.target import Target
from t5scale.train.checkpoint_meta import (
    CheckpointMeta,
    SavedSync,
    check_compatible,
    model_signature,
)
from t5scale.train.config import CheckpointConfig, RunConfig
from t5scale.train.optim import make_optimizer
from t5scale.train.state import StateForm, TrainState


def saved_meta(run: RunConfig, form: StateForm, step: int, data_position: int) -> CheckpointMeta:
    """The meta of `run`'s checkpoint at `step`, its state kept in `form`."""
    return CheckpointMeta(
        step=step, data_position=data_position, seed=run.train.seed,
        model=model_signature(run.model), optimizer=run.optimizer.name,
        precision=form.precision.name,
        sync=SavedSync.of(form.sync, form.layout.replicas), run=run,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Restored:
    state: Any
    meta: CheckpointMeta


@functools.cache  # once per process
def _whole_shards_on_the_cpu() -> None:
    """On the CPU, orbax saves each shard of an array whole instead of replica-parallel.

    Replica-parallel saving has each replica of a replicated shard copy a slice of it to the
    host, cut by one eager jax slice per shard: work for nothing where the devices share the
    host's memory. mt5_tiny on 8 CPU devices: 700 slices per save, 144 slice programs compiled
    at a process's first save (2 s of it), 0.2 s for each later save; whole shards: 0.02 s and
    0.14 s. The files are alike (tensorstore reads either); on GPUs orbax's default stands.
    """
    if Target.local().platform == "cpu":
        whole = ocp.type_handlers.ArrayHandler(use_replica_parallel=False)
        with absl_quiet():  # orbax warns of every override it is asked for
            ocp.type_handlers.register_type_handler(jax.Array, whole, override=True)


@functools.cache  # once per process
def _orbax_failures_quiet() -> None:
    """Each failure of orbax's that matters reaches t5scale as an exception, which says it in
    one line (a damaged checkpoint set aside, a save that failed); this process drops what
    orbax's threads report of it besides:

    - a restore runs its reads in an event loop of its own and closes the loop when the first
      read fails, the others still in flight (orbax's asyncio_utils: run_until_complete, then
      close): as they finish, tensorstore's threads call the closed loop, an unraisable
      `RuntimeError: Event loop is closed` each, and asyncio logs each failed read's task as it
      is collected: 895 lines for one damaged checkpoint of mt5_tiny;
    - each abandoned read of an array that fails itself is orbax's `Exception("Encountered
      error while reading array index ...")` (or tensorstore's "Error reading ... in OCDBT
      database"), raised in a coroutine or task no one awaits any more: an unraisable or an
      asyncio "never retrieved" each, with tensorstore's whole spec (some 600 for a data file
      of mt5_tiny's stage 3 cut in half, 38,000 lines), or, for a read abandoned before it
      began, Python's warning that its coroutine was never awaited;
    - a save that fails logs ERROR with a traceback from each of its background threads, and
      its other writes, left running, as tasks whose exception was never retrieved (one run
      in a few: a race with the first failure).
    """
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        closed = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        if not (closed or str(error).startswith(_ABANDONED_READ)):
            previous(unraisable)

    sys.unraisablehook = hook
    # a read abandoned before it started: Python warns that its coroutine was never awaited
    warnings.filterwarnings(
        "ignore", r"coroutine '_read_array_index_and_device_put' was never awaited", RuntimeWarning
    )
    logging.getLogger("asyncio").addFilter(_not_an_abandoned_read_or_write)
    logging.getLogger("absl").addFilter(_not_an_orbax_error)


# How orbax's sharded read says that tensorstore failed (the cause is the exception's __cause__)
_ABANDONED_READ = "Encountered error while reading array index"
# What an abandoned read's or write's task or future names, of orbax's and tensorstore's
_ORBAX_READS_AND_WRITES = (
    "async_deserialize", "async_serialize", "tensorstore_spec", "_read_array_index",
    _ABANDONED_READ, "in OCDBT database",
)  # fmt: skip


def _not_an_abandoned_read_or_write(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    # "Task", "Future" or "_GatheringFuture exception was never retrieved"
    never_retrieved = "exception was never retrieved" in message.partition("\n")[0]
    of_orbax = any(name in message for name in _ORBAX_READS_AND_WRITES)
    return not (never_retrieved and of_orbax)


def _not_an_orbax_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


class Checkpoints:
    """The run's CheckpointManager, with damage fallback and a compatibility check."""

    def __init__(self, model_dir: str, config: CheckpointConfig, read_only: bool = False):
        _whole_shards_on_the_cpu()
        _orbax_failures_quiet()
        self.directory = (Path(model_dir) / "checkpoints").resolve()
        self.damaged = self.directory.parent / "checkpoints_damaged"
        self.config = config
        # read_only: a reader beside the run (export), which must not remove a save in flight
        self.read_only = read_only
        self._in_flight: int | None = None  # the step of the last save begun
        self.steps_set_aside: list[int] = []  # damaged, by restore_latest
        self.manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        # read_only: orbax warns of each option it sets for a reader itself
        with absl_quiet():
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.config.keep,
                enable_async_checkpointing=self.config.async_save,
                create=not self.read_only,
                cleanup_tmp_directories=not self.read_only,  # what a killed save left behind
                read_only=self.read_only,
            )
            items = ("state", "meta", "fp8")
            return ocp.CheckpointManager(self.directory, options=options, item_names=items)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: CheckpointMeta) -> None:
        """`state` (a TrainState: its FP8 state, if any, as the `fp8` item) and its meta."""
        fp8 = getattr(state, "fp8", None)
        items = {"meta": ocp.args.JsonSave(meta.to_json())}
        if fp8 is not None:
            state, items["fp8"] = state.replace(fp8=None), ocp.args.StandardSave(fp8)
        items["state"] = ocp.args.StandardSave(state)
        with self._written(self._in_flight):  # orbax raises the save in flight's error here
            self.manager.wait_until_finished()
        with self._written(step):
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._in_flight = step

    @contextlib.contextmanager
    def _written(self, step: int | None) -> Iterator[None]:
        """An error of orbax's while it writes `step` as one CheckpointSaveError (a full disk,
        a directory made read-only: OSError, tensorstore's ValueError alike)."""
        try:
            yield
        except CheckpointSaveError:
            raise
        except Exception as error:  # noqa: BLE001
            raise CheckpointSaveError(
                f"checkpoint step {step} was not saved ({error_reason(error)}); the run stops, "
                f"the checkpoints before it in {self.directory} are as they were"
            ) from error

    def restore_latest(
        self, abstract_state: Any, model: ModelConfig, optimizer: str
    ) -> Restored | None:
        """The newest checkpoint that restores, into `abstract_state`'s shardings; None if none.

        `abstract_state` is a pytree of jax.ShapeDtypeStruct with shardings, or a function of
        the checkpoint's meta that gives one (StateForm.restore_target: a checkpoint of another
        synchronisation mode is laid out differently).
        """
        for step in reversed(self.steps()):
            where = f"checkpoint {self.directory}/{step}"
            try:
                data = self.restore(step, meta=ocp.args.JsonRestore()).meta
            except Exception as error:  # noqa: BLE001  (any unreadable checkpoint: fall back)
                self._set_aside(step, error)
                continue
            # A meta that reads as JSON is the checkpoint's, whole: what it says is the user's.
            meta = CheckpointMeta.read(data, where)
            check_compatible(meta, model, optimizer, where)  # a mismatch is the user's: stop
            target = abstract_state(meta) if callable(abstract_state) else abstract_state
            try:
                state = self.restore_state(step, target)
                state = state.replace(fp8=self._restore_fp8(step, meta, target.fp8, where))
            except Exception as error:  # noqa: BLE001
                self._set_aside(step, error)
                continue
            return Restored(state, meta)
        if self.steps_set_aside:
            # Training afresh would write over the run's metrics and drop a converted model's
            # weights, with a warning as its only trace: the user chooses.
            raise ConfigError(
                f"no checkpoint in {self.directory} restores: each was damaged and moved to "
                f"{self.damaged} (steps {', '.join(map(str, self.steps_set_aside))}); to train "
                "afresh, use another MODEL_DIR or empty this one"
            )
        return None

    def restore_state(self, step: int, target: Any) -> Any:
        """The `state` item at `step`, restored into `target` (its FP8 state left to the caller)."""
        return self.restore(step, state=ocp.args.StandardRestore(target.replace(fp8=None))).state

    def _restore_fp8(self, step: int, meta: CheckpointMeta, target: Any, where: str) -> Any:
        """The FP8 state the checkpoint holds for a run that has one (`target` not None): its own,
        or fresh where it has none of this shape (a mixed run's, `convert`'s); None for a run
        without one."""
        has_fp8 = (self.directory / str(step) / "fp8").is_dir()
        if target is None:
            if has_fp8:
                _say(f"{where}: its FP8 scales and amax histories are left out (this run's "
                     "precision has no FP8 matmuls)")  # fmt: skip
            return None
        saved = meta.run.precision.fp8_amax_history if has_fp8 and meta.run else None
        history = _amax_history_length(target)
        if saved == history:
            return self.restore(step, fp8=ocp.args.StandardRestore(target)).fp8
        why = (f"its amax histories are {saved} steps, this run's {history}" if has_fp8
               else "it holds no FP8 state")  # fmt: skip
        _say(f"{where}: {why}; the FP8 scales and amax histories start fresh")
        fresh = fp8_state_like(target)
        return jax.device_put(fresh, jax.tree.map(lambda x: x.sharding, target))

    def meta(self, step: int) -> CheckpointMeta:
        """The meta of the checkpoint at `step`."""
        data = self.restore(step, meta=ocp.args.JsonRestore()).meta
        return CheckpointMeta.read(data, f"checkpoint {self.directory}/{step}")

    def restore(self, step: int, **items) -> Any:
        """The items (orbax restore args by name: state, meta) of the checkpoint at `step`."""
        return self.manager.restore(step, args=ocp.args.Composite(**items))

    def _set_aside(self, step: int, error: Exception) -> None:
        """Move a damaged checkpoint out of orbax's way, keeping it for inspection."""
        reason = error_reason(error)
        self.damaged.mkdir(parents=True, exist_ok=True)
        target = self.damaged / str(step)
        suffix = 1
        while target.exists():
            target, suffix = self.damaged / f"{step}.{suffix}", suffix + 1
        self.steps_set_aside.append(step)
        self.manager.close()
        if jax.process_index() == 0:  # one process moves it; the others wait for that
            shutil.move(str(self.directory / str(step)), target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"t5scale: set aside checkpoint {step}")
        self.manager = self._open()
        print(
            f"t5scale: warning: checkpoint step {step} is damaged ({reason}); moved to {target}, "
            "falling back to the one before",
            file=sys.stderr,
            flush=True,
        )

    def wait(self) -> None:
        with self._written(self._in_flight):
            self.manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self.manager.close()


def error_reason(error: Exception) -> str:
    """What is wrong, in a line: tensorstore's status and its innermost cause ("CODE: opening
    X: opening Y: ...: cause [tensorstore_spec=...]"), or the error's own text. Where orbax
    wrapped tensorstore's error in its own (a sharded read), the wrapped one's."""
    while str(error).startswith(_ABANDONED_READ) and error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(str(error).split()).split(" [tensorstore_spec", 1)[0]
    code, _, causes = text.partition(": ")
    if code.isupper() and causes:
        text = f"{code}: {causes.rsplit(': ', 1)[-1]}"
    return text[:300] or type(error).__name__


def _amax_history_length(fp8: Any) -> int:
    paths = jax.tree_util.tree_flatten_with_path(fp8)[0]
    return next(x.shape[-1] for path, x in paths if str(path[-1].key).endswith("amax_history"))


def _say(line: str) -> None:
    if jax.process_index() == 0:
        print(f"t5scale: {line}", file=sys.stderr, flush=True)


def write_converted(model_dir: str, run: RunConfig, params: Any) -> Path:
    """Step 0 of `run` from imported parameters (numpy): fresh optimizer state, no data read.

    `run` holds what the checkpoint fixes (the imported model, the precision and optimizer it
    is converted for; its meta keeps it). The arrays are written from host memory as they are;
    the run that resumes from this checkpoint lays them out for its own stage and mesh.
    """
    tx = make_optimizer(run.optimizer)
    # Every optax state the optimizers here use starts at zero (moments, factored moments,
    # counts); the abstract state gives its shapes without allocating on a device.
    opt_state = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(tx.init, params))
    state = TrainState(np.zeros((), np.int32), params, opt_state)
    checkpoints = Checkpoints(model_dir, CheckpointConfig(async_save=False))
    if checkpoints.steps():
        checkpoints.close()
        raise ConfigError(
            f"{checkpoints.directory} already holds checkpoints: convert into a new MODEL_DIR"
        )
    meta = CheckpointMeta(
        step=0, data_position=0, seed=0, model=model_signature(run.model),
        optimizer=run.optimizer.name, run=run,
    )  # fmt: skip
    checkpoints.save(0, state, meta)
    checkpoints.close()
    return checkpoints.directory / "0"
