"""The errors a user's input can cause, in one module every layer may import.

Each is reported by the CLI in one line on stderr with its exit code (t5scale/cli.py); none of
them is a bug, so none shows a traceback.
"""

from __future__ import annotations

# Exit codes of the CLI.
USAGE_ERROR = 2  # a configuration, mesh or data set that cannot run
NONFINITE_STOP = 3  # a NaN or Inf stopped training (CheckpointConfig.on_nonfinite = 'stop')
PROCESSES_FAILED = 4  # could not join the other processes, or a peer was lost
COMPILER_ABORTED = 5  # XLA aborted (a C++ check failed) in a command that compiles in a child


class ConfigError(ValueError):
    """A configuration that cannot run (reported in one line, exit code 2)."""


class MeshError(ValueError):
    """A mesh shape that does not fit the devices."""


class DataError(ValueError):
    """Data that cannot be used: a corpus, a vocabulary (one line, exit code 2)."""


class DistributedError(ValueError):
    """Settings that cannot start the processes of a multi-host run."""


class JoinError(RuntimeError):
    """The coordinator or the other processes did not answer within the timeout."""


class UnsupportedJaxError(RuntimeError):
    """A jax release whose private lowering t5scale/xla_cpu.py cannot patch (CPU emulation)."""
