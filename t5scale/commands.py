"""What each `t5scale` command does, given its parsed command line (t5scale/cli.py parses it,
runs it, and turns its errors into one line and an exit code).

Each command imports what it uses when it runs: `t5scale --help`, and a bad flag, answer
without importing JAX, Flax and the rest (docs/benchmarks.md, "CLI start").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from t5scale.errors import INTERRUPTED, ConfigError, Interrupted, leave_now

if TYPE_CHECKING:
    from t5scale.parallel.distributed import PeerWatch
    from t5scale.train.config import RunConfig


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


def _interrupted_before_the_steps(signum, frame) -> None:
    """Ctrl-C while a run sets up or compiles: nothing to save, and a KeyboardInterrupt
    raised into XLA's compile or JAX's callbacks was ignored there, or crashed Python's
    teardown: one line, and out. In the steps, train's own handler stops after a step with a
    checkpoint."""
    leave_now("t5scale: interrupted (Ctrl-C): nothing saved since the last checkpoint", INTERRUPTED)


def train_command(call: Invocation) -> None:
    main_thread = threading.current_thread() is threading.main_thread()  # signals reach it
    previous = signal.signal(signal.SIGINT, _interrupted_before_the_steps) if main_thread else None
    try:
        _train(call)
    finally:
        if previous is not None:  # a caller's own (tests call the CLI in their process)
            signal.signal(signal.SIGINT, previous)


def _train(call: Invocation) -> None:
    import jax

    from t5scale.config import operative_config
    from t5scale.train.config import make_model_dir, model_dir_lock
    from t5scale.train.loop import train

    run = call.run_config()
    if run.train.model_dir:
        make_model_dir(run.train.model_dir)
    call.join_processes(run)
    held = run.train.model_dir and jax.process_index() == 0  # one lock for the run's processes
    with model_dir_lock(run.train.model_dir) if held else contextlib.nullcontext():
        history = train(run, operative_config())
    if jax.process_index() != 0:
        return
    if history:
        steps = f"{len(history)} step{'s' if len(history) > 1 else ''}"
        print(f"done: {steps}, final loss {history[-1].loss:.4f}")
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
        f"process {jax.process_index()}: distributed ok: {jax.process_count()} process"
        f"{'es' if jax.process_count() > 1 else ''}, "
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
    hardware = config.build_hardware()
    try:
        summary = run_study(study, config.study_runs(study), gin_text, hardware=hardware)
    except KeyboardInterrupt:  # its trials stopped (runner.run_all), none half-recorded
        raise Interrupted(
            f"interrupted (Ctrl-C): the finished trials are in {study.study_dir}/results.jsonl, "
            "and the same command goes on from them"
        ) from None
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
    from t5scale.config import build_hardware, build_study_config
    from t5scale.whatif import plan

    run = call.run_config()
    config = build_study_config("plan")
    hardware = build_hardware()  # given: XLA's GPU or TPU compiler, for its devices
    show = _emulate_cpu_devices(config.devices, call.args.json)
    result = plan.run_plan(run, config, show, hardware)
    print(json.dumps(result.to_json(), indent=2) if call.args.json else plan.format_plan(result))


def simulate_command(call: Invocation) -> None:
    from t5scale.config import build_hardware, build_study_config
    from t5scale.whatif import simulate

    run = call.run_config()
    hardware = build_hardware(required=True)
    config = build_study_config("simulate")
    show = _emulate_cpu_devices(hardware.emulated_devices(max(config.nodes)), call.args.json)
    result = simulate.simulate(run, hardware, config, show)
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
