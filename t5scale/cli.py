"""The `t5scale` command: train, params, data-bench, convert.

    t5scale train --gin_file=gin/models/mt5_tiny.gin --gin_file=gin/zero/stage2.gin \\
        --gin.TRAIN_STEPS=20 --gin.MODEL_DIR=/tmp/run
    t5scale params --gin_file=gin/models/mt5_xxl.gin

Bad input (unknown gin file or binding, a mesh that does not divide the devices, an indivisible
batch, a stage outside 0-3) is reported in one line on stderr with exit code 2.
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
    return parser


def _split_gin_bindings(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Pull t5x-style --gin.NAME=VALUE flags out of argv (argparse cannot declare them)."""
    rest, bindings = [], []
    for arg in argv:
        (bindings if arg.startswith("--gin.") else rest).append(arg.removeprefix("--gin."))
    return rest, bindings


def _start_jax(cpu_devices: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", cpu_devices)


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
    from t5scale.config import operative_config
    from t5scale.train.loop import train

    history = train(run, operative_config())
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
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, bindings = _split_gin_bindings(argv)
    args = _parser().parse_args(rest)
    from t5scale.data.config import DataError
    from t5scale.parallel.mesh import MeshError
    from t5scale.train.config import ConfigError

    try:
        return _run(args, bindings)
    except (ConfigError, MeshError, DataError) as error:
        print(f"t5scale: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except FloatingPointError as error:
        print(f"t5scale: error: {error}", file=sys.stderr)
        return NONFINITE_STOP


def _run(args, bindings) -> int:
    from t5scale.config import build_run_config, parse_gin

    parse_gin(args.gin_file, bindings, args.gin_search_paths)
    run = build_run_config()
    if args.command == "params":
        _params(run, args.json)
        return 0
    _start_jax(args.cpu_devices)
    if args.command == "convert":
        _convert(run, args.hf_dir)
        return 0
    if args.command == "data-bench":
        _data_bench(run, args.batches)
        return 0
    _train(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
