"""The errors a user's input can cause, in one module every layer may import.

Each is reported by the CLI in one line on stderr with its exit code (t5scale/cli.py); none of
them is a bug, so none shows a traceback.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from typing import Any, NoReturn

# Exit codes of the CLI.
USAGE_ERROR = 2  # a configuration, mesh or data set that cannot run
NONFINITE_STOP = 3  # a NaN or Inf stopped training (CheckpointConfig.on_nonfinite = 'stop')
PROCESSES_FAILED = 4  # could not join the other processes, or a peer was lost
COMPILER_ABORTED = 5  # XLA aborted (a C++ check failed) in a command that compiles in a child
CHECKPOINT_NOT_SAVED = 6  # a checkpoint could not be written (a full disk, no permission)
INTERRUPTED = 130  # Ctrl-C (SIGINT), the shell's convention: 128 + the signal's number


def leave_now(line: str, code: int) -> NoReturn:
    """`line` on stderr, then exit with `code` at once, from any thread: where Python's own exit
    would wait on threads that never end (JAX's shutdown for a lost process, a compile that
    Ctrl-C cut short) or JAX would abort first. stdout is written out first."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    os._exit(code)


class ConfigError(ValueError):
    """A configuration that cannot run (reported in one line, exit code 2)."""


class MeshError(ValueError):
    """A mesh shape that does not fit the devices."""


class DataError(ValueError):
    """Data that cannot be used: a corpus, a vocabulary (one line, exit code 2)."""


class DistributedError(ValueError):
    """Settings that cannot start the processes of a multi-host run."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written: the run stops (one line, exit code 6) and the
    checkpoints before it stay as they were."""


class Interrupted(Exception):
    """Ctrl-C stopped a run where it stops cleanly: training after a step, with a checkpoint;
    a study with its trials killed and the finished ones recorded (one line, exit code 130)."""


class JoinError(RuntimeError):
    """The coordinator or the other processes did not answer within the timeout."""


class UnsupportedJaxError(RuntimeError):
    """A jax release whose private lowering t5scale/xla_cpu.py cannot patch (CPU emulation)."""


def check_field_types(config: Any) -> None:
    """A ConfigError naming the first field of the dataclass `config` whose value is not of its
    annotated type: gin turns `1.5`, `True` or a bare word into a float, bool or string that
    the checks after it would compare, or use, as something else (1.5 steps run as 2, 'no' is
    true). Lists stand for tuples (gin writes them so); an int stands for a float."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        value, expected = getattr(config, field.name), hints[field.name]
        if not _is_a(value, expected):
            raise ConfigError(
                f"{type(config).__name__}.{field.name} must be {_describe(expected)}, got {value!r}"
            )


def _is_a(value: Any, expected: Any) -> bool:
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin in (tuple, list):
        if not isinstance(value, tuple | list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is_a(item, args[0]) for item in value)
        return not args or (len(args) == len(value) and all(map(_is_a, value, args)))
    if origin is dict or expected is dict:
        return isinstance(value, dict)
    if expected is type(None):
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, expected) if isinstance(expected, type) else True


def _describe(expected: Any) -> str:
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is typing.Literal:
        words = [str(arg) for arg in args]
        return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
    if origin in (tuple, list):
        item = _describe(args[0]) if args else "values"
        return f"a list of {item.removeprefix('an ').removeprefix('a ')}s"
    names = {int: "an integer", float: "a number", bool: "True or False", str: "a string",
             type(None): "None"}  # fmt: skip
    return names.get(expected, getattr(expected, "__name__", str(expected)))
