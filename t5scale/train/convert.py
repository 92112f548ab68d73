"""`t5scale convert`: a Hugging Face mT5 checkpoint (config.json + safetensors) → step 0 of a run
in MODEL_DIR, which `t5scale train` resumes from (the reverse of t5scale/train/export.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path

import jax
import numpy as np

from t5scale.errors import ConfigError
from t5scale.model.hf_import import params_from_hf
from t5scale.train.checkpoint import write_converted
from t5scale.train.config import RunConfig, make_model_dir


@dataclasses.dataclass(frozen=True)
class Converted:
    run: RunConfig  # what the checkpoint fixes: the imported model, its precision and optimizer
    path: Path
    parameters: int


def convert_checkpoint(hf_dir: str, run: RunConfig) -> Converted:
    """`hf_dir`'s model as step 0 in run.train.model_dir, with this run's compute dtype,
    precision and optimizer (the rest is the Hugging Face config's); ConfigErrors in one line
    for no MODEL_DIR, one that cannot be a directory (checked before the long read) and a
    checkpoint that cannot be read."""
    model_dir = run.train.model_dir
    if not model_dir:
        raise ConfigError("convert writes into MODEL_DIR: give --gin.MODEL_DIR=/path")
    made = not Path(model_dir).exists()
    make_model_dir(model_dir)
    try:
        model, params = params_from_hf(hf_dir, run.model.dtype)
    except (ValueError, OSError) as error:
        if made:  # nothing written: no empty MODEL_DIR left behind
            with contextlib.suppress(OSError):
                Path(model_dir).rmdir()
        raise ConfigError(str(error)) from None
    converted = RunConfig(model=model, optimizer=run.optimizer, precision=run.precision)
    path = write_converted(model_dir, converted, params)
    count = sum(math.prod(np.shape(leaf)) for leaf in jax.tree.leaves(params))
    return Converted(converted, path, count)
