"""`t5scale export`: a run's checkpoint → a Hugging Face mT5 directory (t5scale/model/hf_export.py).

The checkpoint holds the canonical form (fp32 parameters, the master in mixed precision, in
the model's shapes), whatever stage, mesh and precision the run trained with; its meta holds
the run (a RunConfig), which gives the model and the vocabulary. A checkpoint written before
metas kept the run holds its operative gin config as text instead: the caller that can read gin
(the CLI, t5scale/config.py) passes `run_of_gin`. It is restored on this process's devices as a
plain fp32 ZeRO-0 run would resume it (orbax reshards), and only the parameters are written.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from t5scale.errors import ConfigError
from t5scale.model import hf_export
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.checkpoint import (
    CheckpointMeta,
    Checkpoints,
    check_compatible,
    error_reason,
)
from t5scale.train.config import CheckpointConfig, RunConfig, check_output_dir
from t5scale.train.precision import PrecisionConfig
from t5scale.train.replicas import ReplicaSyncConfig
from t5scale.train.setup import build_setup


@dataclasses.dataclass(frozen=True)
class Exported:
    step: int
    run: RunConfig
    files: list[Path]
    parameters: int
    tokenizer: bool


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    check_output_dir(out_dir, "--out_dir")
    held = [name for name in hf_export.MODEL_FILES if (out_dir / name).exists()]
    if held and not overwrite:
        raise ConfigError(
            f"--out_dir {out_dir} already holds a model ({', '.join(held)}): choose another "
            "directory, or pass --overwrite"
        )


def _as_exported(run: RunConfig) -> RunConfig:
    """The run as its checkpoint is read here: fp32 (the master), ZeRO-0 over this process's
    devices, replicas synchronous, a batch the devices divide (nothing is trained)."""
    model = dataclasses.replace(run.model, dtype="float32", remat="dots")
    train = dataclasses.replace(run.train, batch_size=jax.device_count(), micro_batches=1)
    return dataclasses.replace(
        run, model=model, train=train, parallel=ParallelConfig(),
        precision=PrecisionConfig(mode="float32"), sync=ReplicaSyncConfig(),
    )  # fmt: skip


def _run_of(
    meta: CheckpointMeta, run_of_gin: Callable[[str], RunConfig] | None, where: str
) -> RunConfig:
    """The run that wrote a checkpoint: its meta's, or from the operative gin config that an
    old checkpoint's meta holds instead."""
    if meta.run is not None:
        return meta.run
    if meta.gin is None:
        raise ConfigError(f"{where} has neither the run nor its gin config in its meta")
    if run_of_gin is None:
        raise ConfigError(
            f"{where} was written before checkpoints kept their run, its meta holds gin text: "
            "`t5scale export` reads it (export_checkpoint needs run_of_gin)"
        )
    return run_of_gin(meta.gin)


@contextlib.contextmanager
def _damage_is_one_line(where: str, step: int, steps: list[int]) -> Iterator[None]:
    """A checkpoint that orbax cannot read (a file cut short or missing) as one ConfigError;
    export moves nothing aside: it only reads."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001  (tensorstore's and orbax's errors alike)
        others = ", ".join(str(other) for other in steps if other != step)
        raise ConfigError(
            f"{where} is damaged ({error_reason(error)})"
            + (f"; export another with --step (there are steps {others})" if others else "")
        ) from error


def export_checkpoint(
    model_dir: str,
    out_dir: str,
    step: int | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES,
    run_of_gin: Callable[[str], RunConfig] | None = None,
) -> Exported:
    """Write MODEL_DIR's checkpoint at `step` (default: the newest) to `out_dir` as transformers
    loads it; a ConfigError in one line for a run without checkpoints, a step it does not
    have, or an out_dir that is a file or already holds a model (unless `overwrite`).

    `run_of_gin` reads the run from the gin config of a checkpoint written before metas kept
    the run (t5scale.config.run_from_gin_text); without it such a checkpoint is a ConfigError."""
    directory = (Path(model_dir) / "checkpoints").resolve()
    if not directory.is_dir():
        raise ConfigError(f"no checkpoint in {directory}: export reads a run's MODEL_DIR")
    checkpoints = Checkpoints(model_dir, CheckpointConfig(), read_only=True)
    try:
        steps = checkpoints.steps()
        if not steps:
            raise ConfigError(f"no checkpoint in {directory}: export reads a run's MODEL_DIR")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ConfigError(
                f"no checkpoint at step {step} in {directory}; it has steps "
                f"{', '.join(map(str, steps))}"
            )
        out = Path(out_dir)
        _check_out_dir(out, overwrite)
        where = f"checkpoint {directory}/{step}"
        with _damage_is_one_line(where, step, steps):
            meta = checkpoints.meta(step)
        run = _run_of(meta, run_of_gin, where)
        check_compatible(meta, run.model, run.optimizer.name, where)
        setup = build_setup(_as_exported(run))
        target = setup.form.restore_target(meta)
        with _damage_is_one_line(where, step, steps):
            state = checkpoints.restore(step, state=ocp.args.StandardRestore(target)).state
    finally:
        checkpoints.close()
    state = setup.form.from_canonical(state, meta)
    params = jax.tree.map(np.asarray, jax.device_get(setup.form.to_canonical(state).params))

    hf_export.remove_export(out)  # with --overwrite: nothing of the model before stays
    files = hf_export.write_model(out, run.model, params, max_shard_bytes)
    tokenizer = run.data.source != "synthetic"
    if tokenizer:
        files += hf_export.write_tokenizer(out, run.data.vocabulary, run.data.extra_ids)
    return Exported(step, run, files, hf_export.parameter_count(run.model), tokenizer)
