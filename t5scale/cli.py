"""The `t5scale` command: one entry per subcommand in COMMANDS (its help, flags and handler).

    t5scale train --gin_file=gin/models/mt5_tiny.gin --gin_file=gin/zero/stage2.gin \\
        --gin.TRAIN_STEPS=20 --gin.MODEL_DIR=/tmp/run
    t5scale params --gin_file=gin/models/mt5_xxl.gin
    launch/local.sh 2 t5scale distributed-check --cpu_devices=4

Bad input (unknown gin file or binding, a mesh that does not divide the devices, an indivisible
batch, a stage outside 0-3) is reported in one line on stderr with exit code 2; a process group that
cannot be joined, or that loses a process, with exit code 4 (t5scale/parallel/distributed.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from t5scale.commands import (
    Invocation,
    convert_command,
    data_bench_command,
    distributed_check_command,
    export_command,
    params_command,
    plan_command,
    report_command,
    simulate_command,
    study_command,
    train_command,
)
from t5scale.errors import (
    CHECKPOINT_NOT_SAVED,
    COMPILER_ABORTED,
    INTERRUPTED,
    NONFINITE_STOP,
    PROCESSES_FAILED,
    USAGE_ERROR,
    CheckpointSaveError,
    ConfigError,
    DataError,
    DistributedError,
    Interrupted,
    JoinError,
    MeshError,
    UnsupportedJaxError,
)

# Set in that child: it runs the command itself.
IN_CHILD = "T5SCALE_COMMAND_CHILD"

DESCRIPTION = (
    "Train mT5 with ZeRO stages 0-3 on a JAX device mesh, and plan, simulate and study how "
    "training spreads over GPU clusters and TPU pods (gin configuration, t5x conventions)."
)


def _count(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (argparse's own one-line error, exit code 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _size(text: str) -> int:
    """An argparse type: bytes from '5GB', '100KB' … (argparse's one-line error otherwise)."""
    from t5scale.model.hf_export import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclasses.dataclass(frozen=True)
class Command:
    help: str
    handler: Callable[[Invocation], None]
    flags: tuple[tuple[str, dict], ...] = ()  # argparse's add_argument(name, **options)
    # Compile any configuration in a child process, so that XLA aborting is one line here.
    isolated: bool = False


JSON_FLAG = ("--json", {"action": "store_true", "help": "print JSON"})
COMMANDS: dict[str, Command] = {
    "train": Command("train a model", train_command),
    "params": Command("parameter count, nothing allocated", params_command, (JSON_FLAG,)),
    "data-bench": Command(
        "examples/s and tokens/s of the input pipeline alone", data_bench_command,
        (("--batches", {"type": _count(0), "default": 50, "help": "batches to time"}),),
    ),
    "convert": Command(
        "a Hugging Face mT5 checkpoint (config.json + safetensors) → step 0 in MODEL_DIR",
        convert_command,
        (("--hf_dir", {"required": True, "help": "as save_pretrained wrote it"}),),
    ),
    "export": Command(
        "a run's checkpoint → a Hugging Face mT5 directory (config.json + safetensors)",
        export_command,
        (("--out_dir", {"required": True, "help": "where to write the model"}),
         ("--step", {"type": _count(0), "default": None, "help": "default: the newest"}),
         ("--overwrite", {"action": "store_true", "help": "replace a model in out_dir"}),
         ("--max_shard_size", {"type": _size, "default": "5GB",
                               "help": "safetensors shard size (5GB)"})),
    ),
    "study": Command(
        "the scaling study: a grid of isolated trials, funneled (gin/study/quick.gin)",
        study_command,
    ),
    "plan": Command(
        "per ZeRO stage: memory per device and collective bytes on DEVICES, compile only",
        plan_command, (JSON_FLAG,), isolated=True,
    ),
    "simulate": Command(
        "predict seconds per step on a GPU cluster or TPU pod (gin/clusters/) per stage and node or slice count",
        simulate_command, (JSON_FLAG,), isolated=True,
    ),
    "report": Command(
        "report.md and PNG plots from a study's results", report_command,
        (("study_dir", {"help": "the STUDY_DIR a study wrote"}),),
    ),
    "distributed-check": Command(
        "join the processes, build the mesh, all-reduce over every device, report",
        distributed_check_command,
    ),
}  # fmt: skip


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is the CLI's one line and exit code 2 like every bad input (the
    usage text is what --help prints)."""

    def error(self, message: str) -> NoReturn:
        print(f"t5scale: error: {self.prog}: {message} (--help lists the flags)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _parser() -> argparse.ArgumentParser:
    common = _OneLineParser(add_help=False)
    common.add_argument("--gin_file", action="append", default=[], help="gin file (repeatable)")
    common.add_argument(
        "--gin_search_paths", action="append", default=[], help="where gin files are looked for"
    )
    common.add_argument(
        "--cpu_devices",
        type=_count(1),
        default=os.environ.get("JAX_NUM_CPU_DEVICES", "8"),  # a string: argparse checks it too
        help="CPU devices to emulate when JAX runs on the CPU (default 8)",
    )
    for flag, kind, what in (
        ("coordinator_address", str, "host:port of process 0 (multi-process runs)"),
        ("num_processes", int, "processes of the run"),
        ("process_id", int, "this process's id, 0 … num_processes-1"),
    ):
        common.add_argument(f"--{flag}", type=kind, help=f"{what}; DistributedConfig.{flag}")
    parser = _OneLineParser(prog="t5scale", description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        subparser = subparsers.add_parser(name, parents=[common], help=command.help)
        for flag, options in command.flags:
            subparser.add_argument(flag, **options)
    return parser


def _split_gin_bindings(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Pull t5x-style --gin.NAME=VALUE flags out of argv (argparse cannot declare them)."""
    rest, bindings = [], []
    for arg in argv:
        (bindings if arg.startswith("--gin.") else rest).append(arg.removeprefix("--gin."))
    return rest, bindings


def run_in_child(argv: Sequence[str]) -> int:
    """The command line again, in a child process whose stderr passes through until XLA fails
    a check; then that check's message is the one line said here (not its stack dump)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "t5scale.cli", *argv],
        env=os.environ | {IN_CHILD: "1"}, stderr=subprocess.PIPE, text=True, errors="replace",
    )  # fmt: skip
    fatal = None
    for line in child.stderr:
        if fatal is None and _GLOG_FATAL.match(line):
            fatal = line.split("] ", 1)[-1].strip()
        if fatal is None:
            sys.stderr.write(line)
            sys.stderr.flush()
    code = child.wait()
    if code >= 0:
        return code
    reason = fatal or "no message"
    print(
        f"t5scale: error: the XLA compiler aborted ({signal.Signals(-code).name}): {reason}",
        file=sys.stderr,
        flush=True,
    )
    return COMPILER_ABORTED


_GLOG_FATAL = re.compile(r"^F\d{4} ")  # absl/glog's fatal lines: F<month><day> <time> ...


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    # Each line out at once, in one write, also into a pipe or a job's log. (Not `python -u`:
    # that unbuffers C's stdout as well, and the C++ libraries' messages, gloo's among them,
    # then come out in pieces that can split a line of ours: launch/local.sh.)
    if callable(getattr(sys.stdout, "reconfigure", None)):
        sys.stdout.reconfigure(line_buffering=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, bindings = _split_gin_bindings(argv)
    args = _parser().parse_args(rest)
    if COMMANDS[args.command].isolated and not os.environ.get(IN_CHILD):
        return run_in_child(argv)
    bindings += [
        f"DistributedConfig.{flag}={getattr(args, flag)}"
        for flag in ("coordinator_address", "num_processes", "process_id")
        if getattr(args, flag) is not None
    ]
    call = Invocation(args, bindings, started)

    def stop(message: str, code: int) -> int:
        print(f"t5scale: error: {message}", file=sys.stderr, flush=True)
        if call.processes is not None:
            call.processes.fail(message, code)  # exits at once on several processes
        return code

    try:
        COMMANDS[args.command].handler(call)
        if call.processes is not None:
            call.processes.done()
        return 0
    except (ConfigError, MeshError, DataError, DistributedError, UnsupportedJaxError) as error:
        return stop(str(error), USAGE_ERROR)
    except FloatingPointError as error:
        return stop(str(error), NONFINITE_STOP)
    except CheckpointSaveError as error:
        return stop(str(error), CHECKPOINT_NOT_SAVED)
    except Interrupted as error:  # Ctrl-C in training's steps: a checkpoint saved
        print(f"t5scale: {error}", file=sys.stderr, flush=True)
        return INTERRUPTED
    except KeyboardInterrupt:  # Ctrl-C before the steps (compiling), or a second one
        return stop("interrupted (Ctrl-C): nothing saved since the last checkpoint", INTERRUPTED)
    except JoinError as error:
        return stop(str(error), PROCESSES_FAILED)
    except Exception as error:
        if call.processes is None or not call.processes.multi_process:
            raise
        import jax

        if isinstance(error, jax.errors.JaxRuntimeError):
            # Most often a collective whose peer is gone: the watch names it and exits meanwhile.
            call.processes.wait_for_verdict()
        traceback.print_exc()
        return stop(f"{type(error).__name__}: {' '.join(str(error).split())[:300]}", 1)


if __name__ == "__main__":
    code = main()
    if code in (CHECKPOINT_NOT_SAVED, INTERRUPTED):
        # Threads that will not end may be left: a failed save's in orbax wait for signals that
        # never come, and Ctrl-C may stop a compile with XLA's threads still at work (Python then
        # crashed in its teardown). Leave without them, stdout and stderr written out first.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
