"""`t5scale export`: a run's checkpoint → a Hugging Face mT5 directory (t5scale/model/hf_export.py).

The checkpoint holds the canonical form (fp32 parameters, the master in mixed precision, in
the model's shapes), whatever stage, mesh and precision the run trained with; its meta holds
the run's operative gin config, which gives the model and the vocabulary. It is restored on
this process's devices as a plain fp32 ZeRO-0 run would resume it (orbax reshards), and only
the parameters are written.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from t5scale.config import build_run_config, parse_gin
from t5scale.errors import ConfigError
from t5scale.model import hf_export
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.checkpoint import Checkpoints, check_compatible
from t5scale.train.config import CheckpointConfig, RunConfig
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
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out_dir {out_dir} is a file, not a directory")
    held = [name for name in hf_export.MODEL_FILES if (out_dir / name).exists()]
    if held and not overwrite:
        raise ConfigError(
            f"--out_dir {out_dir} already holds a model ({', '.join(held)}): choose another "
            "directory, or pass --overwrite"
        )


def _as_exported(run: RunConfig) -> RunConfig:
    """The run as its checkpoint is read here: fp32 (the master), ZeRO-0 over this process's
    devices, replicas synchronous, a batch the devices divide (nothing is trained)."""
    model = dataclasses.replace(run.model, dtype="float32", remat="none")
    train = dataclasses.replace(run.train, batch_size=jax.device_count(), micro_batches=1)
    return dataclasses.replace(
        run, model=model, train=train, parallel=ParallelConfig(),
        precision=PrecisionConfig(mode="float32"), sync=ReplicaSyncConfig(),
    )  # fmt: skip


def _run_of(meta: dict) -> RunConfig:
    """The run's configuration, from the operative gin config its checkpoint's meta holds."""
    with tempfile.NamedTemporaryFile("w", suffix=".gin", encoding="utf-8") as written:
        written.write(meta.get("gin", ""))
        written.flush()
        parse_gin([written.name], [])
    return build_run_config()


def export_checkpoint(
    model_dir: str,
    out_dir: str,
    step: int | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES,
) -> Exported:
    """Write MODEL_DIR's checkpoint at `step` (default: the newest) to `out_dir` as transformers
    loads it; a ConfigError in one line for a run without checkpoints, a step it does not
    have, or an out_dir that is a file or already holds a model (unless `overwrite`)."""
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
        meta = checkpoints.restore(step, meta=ocp.args.JsonRestore())["meta"]
        run = _run_of(meta)
        check_compatible(meta, run.model, run.optimizer.name, f"checkpoint {directory}/{step}")
        setup = build_setup(_as_exported(run))
        target = setup.form.restore_target(meta)
        state = checkpoints.restore(step, state=ocp.args.StandardRestore(target))["state"]
    finally:
        checkpoints.close()
    state = setup.form.from_canonical(state, meta)
    params = jax.tree.map(np.asarray, jax.device_get(setup.form.to_canonical(state).params))

    files = hf_export.write_model(out, run.model, params, max_shard_bytes)
    tokenizer = run.data.source != "synthetic"
    if tokenizer:
        files += hf_export.write_tokenizer(out, run.data.vocabulary, run.data.extra_ids)
    return Exported(step, run, files, hf_export.parameter_count(run.model), tokenizer)
