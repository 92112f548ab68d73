"""The errors a user's input can cause, in one module every layer may import.

Each is reported by the CLI in one line on stderr with its exit code (t5scale/cli.py); none of
them is a bug, so none shows a traceback.
"""

from __future__ import annotations

BAD_INPUT = 2  # exit code: a configuration, mesh or data set that cannot run
PROCESSES_FAILED = 4  # exit code: could not join the processes, or a peer was lost


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
