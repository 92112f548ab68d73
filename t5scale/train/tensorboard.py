"""Scalars as TensorBoard event files, through TensorBoard's own writer.

`tensorboard.summary.Writer` writes the event format TensorBoard reads without importing
TensorFlow (clu's writers, which t5x uses, import it: seconds at every start). Only process 0
writes; the others get a writer that does nothing, so callers need not ask.

TensorBoard's file layer still imports TensorFlow wherever it is installed (as it is here, for
seqio) unless TensorBoard is told to use its own pure-Python stand-in, which writes local files
the same way: `_without_tensorflow` does that for local log directories in a process that has
not loaded TensorFlow (3.7 s of every synthetic-data run and every study trial, 2026-11-27).
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import jax


class ScalarWriter:
    """write(step, {name: value}) → TensorBoard scalars under `logdir`; None values skipped."""

    def __init__(self, logdir: str | Path | None):
        self._writer = None
        if logdir is not None and jax.process_index() == 0:
            if "://" not in str(logdir):  # a remote file system needs TensorFlow's gfile
                _without_tensorflow()
            from tensorboard.summary import DirectoryOutput, Writer

            Path(logdir).mkdir(parents=True, exist_ok=True)
            self._writer = Writer(DirectoryOutput(str(logdir)))

    def write(self, step: int, scalars: dict[str, Any]) -> None:
        if self._writer is None:
            return
        for name, value in scalars.items():
            if value is not None and math.isfinite(float(value)):
                self._writer.add_scalar(name, float(value), step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> ScalarWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _without_tensorflow() -> None:
    """Point TensorBoard at its TensorFlow stand-in, unless TensorFlow is loaded already: the
    module `tensorboard.compat.notf` existing is TensorBoard's own switch for that
    (tensorboard/compat/__init__.py)."""
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault(
            "tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf")
        )
