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
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from t5scale.errors import (
    COMPILER_ABORTED,
    NONFINITE_STOP,
    PROCESSES_FAILED,
    USAGE_ERROR,
    ConfigError,
    DataError,
    DistributedError,
    JoinError,
    MeshError,
    UnsupportedJaxError,
)

if TYPE_CHECKING:
    from t5scale.parallel.distributed import PeerWatch
    from t5scale.train.config import RunConfig

# Each command imports what it uses when it runs: `t5scale --help`, and a bad flag, answer
# without importing JAX, Flax and the rest (docs/benchmarks.md, "CLI start").

# Set in that child: it runs the command itself.
IN_CHILD = "T5SCALE_COMMAND_CHILD"


@dataclasses.dataclass
class Invocation:
    """One command line: its parsed flags, its gin bindings, and the processes once joined."""

    args: argparse.Namespace
    bindings: list[str]
    started: float
    processes: PeerWatch | None = None

    def run_config(self) -> RunConfig:
        from t5scale.config import build_run_config, parse_gin

        parse_gin(self.args.gin_file, self.bindings, self.args.gin_search_paths)
        return build_run_config()

    def join_processes(self, run: RunConfig) -> None:
        """The distributed runtime (before anything uses a device), with `--cpu_devices`
        emulated devices and their workarounds where the backend is the CPU."""
        from t5scale import xla_cpu
        from t5scale.parallel.distributed import join_processes

        xla_cpu.configure_cpu_devices(self.args.cpu_devices)
        self.processes = join_processes(run.distributed)
        xla_cpu.patch_cpu_collectives()


# ---- the commands -------------------------------------------------------------------------


def train_command(call: Invocation) -> None:
    import jax

    from t5scale.config import operative_config
    from t5scale.train.config import make_model_dir
    from t5scale.train.loop import train

    run = call.run_config()
    if run.train.model_dir:
        make_model_dir(run.train.model_dir)
    call.join_processes(run)
    history = train(run, operative_config())
    if jax.process_index() != 0:
        return
    if history:
        print(f"done: {len(history)} steps, final loss {history[-1].loss:.4f}")
    if history and run.train.model_dir:
        print(
            f"wrote {run.train.model_dir}/metrics.jsonl, config.gin, step_analysis.json, "
            "checkpoints/"
        )


def params_command(call: Invocation) -> None:
    import math

    import flax.linen as nn
    import jax

    from t5scale.model.mt5 import abstract_params
    from t5scale.model.sizes import parameter_breakdown

    run = call.run_config()
    shapes = nn.meta.unbox(abstract_params(run.model))
    breakdown = parameter_breakdown(shapes)
    total = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))
    if call.args.json:
        print(json.dumps({"model": run.model.name, "parameters": total, "breakdown": breakdown}))
        return
    print(f"{run.model.name}: {total:,} parameters")
    for part, count in breakdown.items():
        print(f"  {part:<24} {count:>16,}  {100 * count / total:5.1f}%")


def data_bench_command(call: Invocation) -> None:
    from t5scale.data.throughput import measure_throughput

    run = call.run_config()
    call.join_processes(run)
    found = measure_throughput(
        run.data, run.train.batch_size, run.train.seed, run.model.vocab_size, call.args.batches
    )
    print(f"pipeline ready in {found.ready_s:.1f} s (first batch included)")
    print(found.line())


def convert_command(call: Invocation) -> None:
    from pathlib import Path

    from t5scale.config import gin_text_of
    from t5scale.train.convert import convert_checkpoint

    run = call.run_config()
    call.join_processes(run)
    done = convert_checkpoint(call.args.hf_dir, run)
    model_dir = run.train.model_dir
    model_gin = gin_text_of(done.run.model, done.run.precision)
    Path(model_dir, "model.gin").write_text(model_gin, encoding="utf-8")  # for people
    print(f"{done.parameters:,} parameters from {call.args.hf_dir} → {done.path}")
    print(
        f"train from it: t5scale train --gin_file={model_dir}/model.gin --gin.MODEL_DIR={model_dir}"
    )


def export_command(call: Invocation) -> None:
    from t5scale import xla_cpu
    from t5scale.config import run_from_gin_text
    from t5scale.train.export import export_checkpoint

    model_dir = call.run_config().train.model_dir
    if not model_dir:
        raise ConfigError("export reads a run: give --gin.MODEL_DIR=/path")
    xla_cpu.emulate_cpu_devices(call.args.cpu_devices)
    done = export_checkpoint(
        model_dir, call.args.out_dir, call.args.step, call.args.overwrite,
        call.args.max_shard_size,
        run_of_gin=run_from_gin_text,  # checkpoints whose meta holds gin text, not the run
    )  # fmt: skip
    print(f"{done.run.model.name} step {done.step}: {done.parameters:,} parameters → "
          f"{call.args.out_dir}")  # fmt: skip
    print("  " + ", ".join(path.name for path in done.files))
    if not done.tokenizer:
        print("  no tokenizer: the run trained on synthetic tokens (DataConfig.source)")
    print(
        f"load it: transformers.MT5ForConditionalGeneration.from_pretrained({call.args.out_dir!r})"
    )


def distributed_check_command(call: Invocation) -> None:
    """Prove the processes work together: every device adds its process id + 1 in one all-reduce."""
    import jax

    from t5scale.parallel.distributed import all_reduce_check
    from t5scale.parallel.mesh import describe_mesh, make_mesh

    run = call.run_config()
    call.join_processes(run)
    mesh = make_mesh(run.parallel)
    print(f"process {jax.process_index()}: {describe_mesh(mesh, run.parallel)}", flush=True)
    got, expected = all_reduce_check(mesh)
    if got != expected:
        raise RuntimeError(f"all-reduce over the mesh gave {got}, expected {expected}")
    print(
        f"process {jax.process_index()}: distributed ok: {jax.process_count()} processes, "
        f"{jax.device_count()} devices, all-reduce {got:g} as expected; "
        f"{time.perf_counter() - call.started:.1f} s from start",
        flush=True,
    )


def study_command(call: Invocation) -> None:
    """The grid's trials each run in a process of their own: this one starts no device."""
    from t5scale import config
    from t5scale.study.report import write_report
    from t5scale.study.runner import run_study

    config.parse_gin(call.args.gin_file, call.bindings, call.args.gin_search_paths)
    study, gin_text = config.build_study_config(), config.operative_config()
    # a cluster file: the compile-only rounds compile for its GPUs or TPU slices
    cluster = config.build_cluster_config()
    summary = run_study(study, config.study_runs(study), gin_text, cluster=cluster)
    print("\n".join(summary.lines(study.study_dir)))
    if not summary.completed:
        raise ConfigError(
            f"no trial of the study completed ({summary.trials} trials; why: "
            f"{study.study_dir}/funnel.md and results.jsonl): the report is skipped"
        )
    print(f"report: {write_report(study.study_dir)}")


def report_command(call: Invocation) -> None:
    from t5scale.study.report import write_report

    path = write_report(call.args.study_dir)
    print(f"wrote {path} and its plots")


def plan_command(call: Invocation) -> None:
    from t5scale.config import build_cluster_config, build_study_config
    from t5scale.whatif import plan

    run = call.run_config()
    config = build_study_config("plan")
    cluster = build_cluster_config()  # given: XLA's GPU or TPU compiler, for its devices
    show = _emulate_cpu_devices(config.devices, call.args.json)
    result = plan.run_plan(run, config, show, cluster)
    print(json.dumps(result.to_json(), indent=2) if call.args.json else plan.format_plan(result))


def simulate_command(call: Invocation) -> None:
    from t5scale.config import build_cluster_config, build_study_config
    from t5scale.whatif import simulate
    from t5scale.whatif.tpu_pod import TpuPodConfig

    run = call.run_config()
    cluster = build_cluster_config(required=True)
    config = build_study_config("simulate")
    # a TPU pod compiles for its chips: no CPU devices to emulate beyond one
    gpus = 1 if isinstance(cluster, TpuPodConfig) else cluster.gpus_per_node
    show = _emulate_cpu_devices(max(config.nodes) * gpus, call.args.json)
    result = simulate.simulate(run, cluster, config, show)
    print(
        json.dumps(result.to_json(), indent=2)
        if call.args.json
        else simulate.format_simulation(result)
    )


def _emulate_cpu_devices(count: int, as_json: bool) -> Callable[[str], None]:
    """Emulated CPU devices even on a GPU host (plan and simulate answer for devices they do
    not have), unless JAX already runs here (cli.main called in a process that has used it:
    the devices are then what they are, and a plan that needs more says so); progress goes to
    stderr when stdout is JSON."""
    import jax
    from jax._src import xla_bridge  # backends_are_initialized: no public equivalent

    from t5scale import xla_cpu

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        xla_cpu.emulate_cpu_devices(count)
    if as_json:
        return lambda line: print(line, file=sys.stderr, flush=True)
    return print


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
        "predict seconds per step on a GPU cluster (gin/clusters/) per stage and node count",
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
    parser = _OneLineParser(prog="t5scale", description=__doc__.split("\n")[0])
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
    sys.exit(main())
