"""Checkpoint save and restore time and size on disk (AdamW state, fp32), per model.

    python bench/bench_checkpoint.py --models mt5_tiny mt5_small --devices 8 --stage 3

For each model: the train state is created in its shardings, then saved `--repeats` times into
a fresh directory. Reported: the time `save` blocks the training loop (the copy to host memory),
the time until the files are complete, the restore time into the same shardings, and the
checkpoint's size on disk; medians over the repeats.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mt5_tiny", "mt5_small"])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    import jax

    from t5scale import xla_cpu

    xla_cpu.emulate_cpu_devices(args.devices)
    from t5scale.model.sizes import preset
    from t5scale.parallel.mesh import ParallelConfig
    from t5scale.train.checkpoint import CheckpointMeta, Checkpoints, model_signature
    from t5scale.train.config import CheckpointConfig, RunConfig, TrainConfig
    from t5scale.train.setup import build_setup

    root = Path(args.dir or tempfile.mkdtemp(prefix="t5scale_ckpt_bench_"))
    print(f"{jax.devices()[0].platform}: {args.devices} devices, ZeRO stage {args.stage}, "
          f"AdamW, fp32; median of {args.repeats} saves; writing to {root}")  # fmt: skip
    print("| model | parameters | size on disk | save blocks s | save complete s | restore s |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        model = preset(name)
        parallel = ParallelConfig(zero_stage=args.stage)
        run = RunConfig(model=model, parallel=parallel, train=TrainConfig(batch_size=args.devices))
        setup = build_setup(run)
        state = setup.create_state(seed=0)
        meta = CheckpointMeta(step=0, data_position=0, model=model_signature(model),
                              optimizer="adamw")  # fmt: skip
        blocks, completes, restores, size = [], [], [], 0
        for repeat in range(args.repeats):
            directory = root / f"{name}_{repeat}"
            checkpoints = Checkpoints(str(directory), CheckpointConfig())
            started = time.perf_counter()
            checkpoints.save(1, state, meta)
            blocks.append(time.perf_counter() - started)
            checkpoints.wait()
            completes.append(time.perf_counter() - started)
            size = _size(directory / "checkpoints" / "1")
            started = time.perf_counter()
            restored = checkpoints.restore_latest(setup.state, model, "adamw")
            jax.block_until_ready(restored.state)
            restores.append(time.perf_counter() - started)
            checkpoints.close()
            del restored
            shutil.rmtree(directory)
        params = sum(x.size for x in jax.tree.leaves(state.params))
        print(
            f"| {name} | {params:,} | {size / 2**20:,.1f} MiB | {statistics.median(blocks):.2f} | "
            f"{statistics.median(completes):.2f} | {statistics.median(restores):.2f} |",
            flush=True,
        )
        del state
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    os.sync()


if __name__ == "__main__":
    main()
