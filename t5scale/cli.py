"""The `t5scale` command: train, params, data-bench, convert, cluster-check.

    t5scale train --gin_file=gin/models/mt5_tiny.gin --gin_file=gin/zero/stage2.gin \\
        --gin.TRAIN_STEPS=20 --gin.MODEL_DIR=/tmp/run
    t5scale params --gin_file=gin/models/mt5_xxl.gin
    launch/local.sh 2 t5scale cluster-check --cpu_devices=4

Bad input (unknown gin file or binding, a mesh that does not divide the devices, an indivisible
batch, a stage outside 0-3) is reported in one line on stderr with exit code 2; a cluster that
cannot be joined, or that loses a process, with exit code 4 (t5scale/parallel/cluster.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

USAGE_ERROR = 2
NONFINITE_STOP = 3  # a NaN or Inf stopped training (CheckpointConfig.on_nonfinite = 'stop')


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--gin_file", action="append", default=[], help="gin file (repeatable)")
    common.add_argument(
        "--gin_search_paths", action="append", default=[], help="where gin files are looked for"
    )
    common.add_argument(
        "--cpu_devices",
        type=int,
        default=int(os.environ.get("JAX_NUM_CPU_DEVICES", 8)),
        help="CPU devices to emulate when JAX runs on the CPU (default 8)",
    )
    for flag, kind, what in (
        ("coordinator_address", str, "host:port of process 0 (multi-process runs)"),
        ("num_processes", int, "processes in the cluster"),
        ("process_id", int, "this process's id, 0 … num_processes-1"),
    ):
        common.add_argument(f"--{flag}", type=kind, help=f"{what}; DistributedConfig.{flag}")
    parser = argparse.ArgumentParser(prog="t5scale", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("train", parents=[common], help="train a model")
    params = commands.add_parser(
        "params", parents=[common], help="parameter count, nothing allocated"
    )
    params.add_argument("--json", action="store_true", help="print JSON")
    data_bench = commands.add_parser(
        "data-bench", parents=[common], help="examples/s and tokens/s of the input pipeline alone"
    )
    data_bench.add_argument("--batches", type=int, default=50, help="batches to time")
    convert = commands.add_parser(
        "convert",
        parents=[common],
        help="a Hugging Face mT5 checkpoint (config.json + safetensors) → step 0 in MODEL_DIR",
    )
    convert.add_argument("--hf_dir", required=True, help="as save_pretrained wrote it")
    commands.add_parser(
        "study",
        parents=[common],
        help="the scaling study: a grid of isolated trials, funneled (gin/study/quick.gin)",
    )
    plan = commands.add_parser(
        "plan",
        parents=[common],
        help="per ZeRO stage: memory per device and collective bytes on DEVICES, compile only",
    )
    plan.add_argument("--json", action="store_true", help="print JSON")
    simulate = commands.add_parser(
        "simulate",
        parents=[common],
        help="predict seconds per step on a GPU cluster (gin/clusters/) per stage and node count",
    )
    simulate.add_argument("--json", action="store_true", help="print JSON")
    report = commands.add_parser(
        "report", parents=[common], help="report.md and PNG plots from a study's results"
    )
    report.add_argument("study_dir", help="the STUDY_DIR a study wrote")
    commands.add_parser(
        "cluster-check",
        parents=[common],
        help="join the cluster, build the mesh, all-reduce over every device, report",
    )
    return parser


def _split_gin_bindings(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Pull t5x-style --gin.NAME=VALUE flags out of argv (argparse cannot declare them)."""
    rest, bindings = [], []
    for arg in argv:
        (bindings if arg.startswith("--gin.") else rest).append(arg.removeprefix("--gin."))
    return rest, bindings


def _start_jax(run, cpu_devices: int):
    """Emulated CPU devices, then the distributed runtime (before anything uses a device)."""
    import jax

    from t5scale.parallel.cluster import start_cluster

    jax.config.update("jax_num_cpu_devices", cpu_devices)
    return start_cluster(run.distributed)


def _cluster_check(run, started: float) -> None:
    """Prove the cluster: every device adds its process id + 1 in one all-reduce."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from t5scale.parallel.mesh import AXES, describe_mesh, make_mesh

    mesh = make_mesh(run.parallel)
    print(f"process {jax.process_index()}: {describe_mesh(mesh, run.parallel)}", flush=True)
    ids = np.vectorize(lambda device: device.process_index + 1)(mesh.devices)
    values = jax.make_array_from_callback(
        ids.shape, NamedSharding(mesh, P(*AXES)), lambda index: ids[index].astype(np.float32)
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(values)
    got, expected = float(total), float(ids.sum())
    if got != expected:
        raise RuntimeError(f"all-reduce over the mesh gave {got}, expected {expected}")
    print(
        f"process {jax.process_index()}: cluster ok: {jax.process_count()} processes, "
        f"{jax.device_count()} devices, all-reduce {got:g} as expected; "
        f"{time.perf_counter() - started:.1f} s from start",
        flush=True,
    )


def _params(run, as_json: bool) -> None:
    import math

    import flax.linen as nn
    import jax

    from t5scale.model.mt5 import abstract_params
    from t5scale.model.sizes import parameter_breakdown

    shapes = nn.meta.unbox(abstract_params(run.model))
    breakdown = parameter_breakdown(shapes)
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    if as_json:
        print(json.dumps({"model": run.model.name, "parameters": total, "breakdown": breakdown}))
        return
    print(f"{run.model.name}: {total:,} parameters")
    for part, count in breakdown.items():
        print(f"  {part:<24} {count:>16,}  {100 * count / total:5.1f}%")


def _train(run) -> None:
    import jax

    from t5scale.config import operative_config
    from t5scale.train.loop import train

    history = train(run, operative_config())
    if jax.process_index() != 0:
        return
    if history:
        last = history[-1]
        print(f"done: {len(history)} steps, final loss {last['loss']:.4f}")
    if history and run.train.model_dir:
        print(
            f"wrote {run.train.model_dir}/metrics.jsonl, config.gin, step_analysis.json, "
            "checkpoints/"
        )


def _convert(run, hf_dir: str) -> None:
    import dataclasses
    import math
    from pathlib import Path

    import jax
    import numpy as np

    from t5scale.model.hf_import import params_from_hf
    from t5scale.train.checkpoint import write_converted
    from t5scale.train.config import ConfigError

    model_dir = run.train.model_dir
    if not model_dir:
        raise ConfigError("convert writes into MODEL_DIR: give --gin.MODEL_DIR=/path")
    try:
        model, params = params_from_hf(hf_dir)
    except (ValueError, OSError) as error:
        raise ConfigError(str(error)) from None
    model_gin = "".join(
        f"ModelConfig.{name} = {value!r}\n" for name, value in dataclasses.asdict(model).items()
    )
    Path(model_dir).mkdir(parents=True, exist_ok=True)
    path = write_converted(model_dir, model, run.optimizer, params, model_gin)
    Path(model_dir, "model.gin").write_text(model_gin, encoding="utf-8")
    count = sum(math.prod(np.shape(x)) for x in jax.tree.leaves(params))
    print(f"{count:,} parameters from {hf_dir} → {path}")
    print(
        f"train from it: t5scale train --gin_file={model_dir}/model.gin --gin.MODEL_DIR={model_dir}"
    )


def _data_bench(run, batches: int) -> None:
    import time

    import numpy as np

    from t5scale.data.loader import host_batches

    cfg = run.data
    started = time.perf_counter()
    stream = host_batches(cfg, run.train.batch_size, run.train.seed, run.model.vocab_size)
    first = next(stream)
    print(f"pipeline ready in {time.perf_counter() - started:.1f} s (first batch included)")
    examples = tokens = 0
    started = time.perf_counter()
    for index, batch in zip(range(batches), stream, strict=False):
        # packed examples: one per segment id per row; tokens: non-padding, both sides
        examples += sum(len(np.unique(row[row > 0])) for row in batch["encoder_segment_ids"])
        tokens += int(np.count_nonzero(batch["encoder_input_tokens"]))
        tokens += int(np.count_nonzero(batch["decoder_target_tokens"]))
        done = index + 1
    elapsed = time.perf_counter() - started
    slots = done * len(first["encoder_input_tokens"]) * (cfg.input_length + cfg.target_length)
    print(
        f"{cfg.source}: {done} batches of {len(first['encoder_input_tokens'])} in {elapsed:.2f} s: "
        f"{examples / elapsed:,.0f} examples/s, {tokens / elapsed:,.0f} tokens/s "
        f"({slots / elapsed:,.0f} token slots/s incl. padding; lengths "
        f"{cfg.input_length}/{cfg.target_length})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    import time

    started = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, bindings = _split_gin_bindings(argv)
    args = _parser().parse_args(rest)
    bindings += [
        f"DistributedConfig.{flag}={getattr(args, flag)}"
        for flag in ("coordinator_address", "num_processes", "process_id")
        if getattr(args, flag) is not None
    ]
    from t5scale.data.config import DataError
    from t5scale.parallel.cluster import CLUSTER_FAILED, JoinError
    from t5scale.parallel.mesh import MeshError
    from t5scale.train.config import ConfigError

    cluster = None  # the PeerWatch once started: a failure is announced to the peers

    def stop(message: str, code: int) -> int:
        print(f"t5scale: error: {message}", file=sys.stderr, flush=True)
        if cluster is not None:
            cluster.fail(message, code)  # exits at once on several processes
        return code

    try:
        if args.command in ("study", "report", "plan", "simulate"):
            _study_command(args, bindings)
            return 0
        run = _configure(args, bindings)
        if args.command == "params":
            _params(run, args.json)
            return 0
        cluster = _start_jax(run, args.cpu_devices)
        _run(args, run, started)
        cluster.done()
        return 0
    except (ConfigError, MeshError, DataError) as error:
        return stop(str(error), USAGE_ERROR)
    except FloatingPointError as error:
        return stop(str(error), NONFINITE_STOP)
    except JoinError as error:
        return stop(str(error), CLUSTER_FAILED)
    except Exception as error:
        if cluster is None or not cluster.multi_process:
            raise
        import jax

        if isinstance(error, jax.errors.JaxRuntimeError):
            # Most often a collective whose peer is gone: the watch names it and exits meanwhile.
            cluster.wait_for_verdict()
        import traceback

        traceback.print_exc()
        return stop(f"{type(error).__name__}: {' '.join(str(error).split())[:300]}", 1)


def _study_command(args, bindings) -> None:
    """study, report and plan run no step in this process (plan compiles, on the CPU)."""
    if args.command in ("plan", "simulate"):
        _plan_or_simulate(args, bindings)
        return
    if args.command == "report":
        from t5scale.study.report import write_report

        path = write_report(args.study_dir)
        print(f"wrote {path} and its plots")
        return
    from t5scale.config import build_study_config, operative_config, parse_gin
    from t5scale.study.report import write_report
    from t5scale.study.runner import run_study

    parse_gin(args.gin_file, bindings, args.gin_search_paths)
    study = build_study_config()
    summary = run_study(study, operative_config())
    print(
        f"study done: {summary['trials']} trials in {summary['elapsed_s'] / 60:.1f} min; "
        f"{study.study_dir}/results.jsonl, {study.study_dir}/funnel.md"
    )
    print(f"report: {write_report(study.study_dir)}")


def _plan_or_simulate(args, bindings) -> None:
    import jax

    from t5scale.config import build_run_config, build_study_config, parse_gin
    from t5scale.study import plan, simulate

    parse_gin(args.gin_file, bindings, args.gin_search_paths)
    run = build_run_config()
    if args.command == "plan":
        config = build_study_config("plan")
        devices = config.devices
    else:
        cluster, config = build_study_config("cluster"), build_study_config("simulate")
        devices = max(config.nodes) * cluster.gpus_per_node
    # Emulated CPU devices even on a GPU host: both answer for devices they do not have.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    show = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    if args.command == "plan":
        result = plan.run_plan(run, config, show)
        text = plan.format_plan(result)
    else:
        result = simulate.simulate(run, cluster, config, show)
        text = simulate.format_simulation(result)
    print(json.dumps(result, indent=2) if args.json else text)


def _configure(args, bindings):
    from t5scale.config import build_run_config, parse_gin

    parse_gin(args.gin_file, bindings, args.gin_search_paths)
    return build_run_config()


def _run(args, run, started: float) -> None:
    if args.command == "cluster-check":
        _cluster_check(run, started)
    elif args.command == "convert":
        _convert(run, args.hf_dir)
    elif args.command == "data-bench":
        _data_bench(run, args.batches)
    else:
        _train(run)


if __name__ == "__main__":
    sys.exit(main())
