"""Does DiLoCo at moderate H stay close to synchronous training? mt5_tiny on the shipped corpus.

    python bench/diloco_learning.py [--steps 512] [--out docs/diloco_learning.json]
        [--plot docs/diloco_learning.png]
    python bench/diloco_learning.py --steps 2 --batch_size 8 --validate_every 2 --replicas 2 \
        --every 2 --modes diloco --out /tmp/d.json --plot /tmp/d.png   # the script's check

Every run sees the same tokens: the same global batches of the shipped corpus (span corruption,
seqio), split over 8 emulated CPU devices as replica × zero, ZeRO stage 1 inside each replica,
AdamW. The synchronous runs reduce gradients over every device each step; the DiLoCo runs
(Douillard et al., 2023: outer Nesterov SGD, learning rate 0.7, momentum 0.9) and local SGD
runs take H steps per replica between synchronisations. Each run ends on a synchronisation and
its validation loss is that of the synchronised parameters, on the corpus's held-out lines.
Bytes between replicas are XLA's compiled collectives over `replica` per device (the outer step
over H), per token of the global batch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from t5scale import xla_cpu  # noqa: E402

jax.config.update("jax_platforms", "cpu")
xla_cpu.emulate_cpu_devices(8)

from t5scale.config import build_run_config, parse_gin  # noqa: E402
from t5scale.train.loop import train  # noqa: E402
from t5scale.train.setup import build_setup  # noqa: E402

REPLICAS = (2, 4)
EVERY = (1, 8, 32)


def bindings(mode: str, replicas: int, every: int, args) -> list[str]:
    return [
        "ParallelConfig.zero_stage=1", f"ParallelConfig.replica={replicas}",
        f"ReplicaSyncConfig.mode='{mode}'", f"ReplicaSyncConfig.every={every}",
        f"TRAIN_STEPS={args.steps}", f"BATCH_SIZE={args.batch_size}", "INPUT_LENGTH=128",
        "TARGET_LENGTH=32", "OptimizerConfig.learning_rate=3e-3", "OptimizerConfig.warmup_steps=50",
        f"DataConfig.validation_every={args.validate_every}", "DataConfig.validation_batches=8",
        "TrainConfig.log_every=64",
    ]  # fmt: skip


def one_run(mode: str, replicas: int, every: int, args) -> dict:
    parse_gin(["gin/models/mt5_tiny.gin", "gin/data/corpus.gin"],
              bindings(mode, replicas, every, args))  # fmt: skip
    run = build_run_config()
    sync = build_setup(run).compile().analysis.replica_sync
    started = time.perf_counter()
    history = train(run)
    validation = [(r.step, r.validation_loss) for r in history if r.validation_loss is not None]
    return {
        "mode": mode,
        "replicas": replicas,
        "every": every,
        "steps": args.steps,
        "tokens": run.tokens_per_step * args.steps,
        "final_validation_loss": validation[-1][1],
        "final_train_loss": history[-1].loss,
        "validation": validation,
        "bytes_over_replica_per_token": sync.per_step.bytes_over_replica / run.tokens_per_step,
        "bytes_per_token": sync.per_step.bytes / run.tokens_per_step,
        "wall_s": time.perf_counter() - started,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| replicas | synchronisation | H | final validation loss | vs synchronous | "
        "bytes between replicas per token (per device) | all collective bytes per token |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["replicas"], r["mode"] != "every_step", r["mode"],
                                            r["every"])):  # fmt: skip
        sync = next(s for s in results if s["mode"] == "every_step"
                    and s["replicas"] == r["replicas"])  # fmt: skip
        delta = r["final_validation_loss"] - sync["final_validation_loss"]
        lines.append(
            f"| {r['replicas']} | {r['mode'].replace('_', ' ')} | "
            f"{r['every'] if r['mode'] != 'every_step' else '–'} | "
            f"{r['final_validation_loss']:.4f} | {delta:+.4f} | "
            f"{r['bytes_over_replica_per_token']:,.0f} | {r['bytes_per_token']:,.0f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replica_counts = sorted({r["replicas"] for r in results})
    figure, axes = plt.subplots(1, len(replica_counts), figsize=(11, 4), sharey=True,
                                squeeze=False)  # fmt: skip
    axes = axes[0]
    for axis, replicas in zip(axes, replica_counts, strict=True):
        for r in (r for r in results if r["replicas"] == replicas):
            steps, losses = zip(*r["validation"], strict=True)
            label = "synchronous" if r["mode"] == "every_step" else f"{r['mode']} H={r['every']}"
            style = "k-" if r["mode"] == "every_step" else "-" if r["mode"] == "diloco" else ":"
            axis.plot(steps, losses, style, label=label, marker=".")
        axis.set_title(f"mt5_tiny, {replicas} replicas × {8 // replicas} devices (ZeRO-1)")
        axis.set_xlabel("step (same global batches in every run)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (shipped corpus)")
    axes[-1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--validate_every", type=int, default=64)
    parser.add_argument("--modes", default="diloco,local_sgd")
    parser.add_argument("--replicas", type=int, nargs="+", default=REPLICAS)
    parser.add_argument("--every", type=int, nargs="+", default=EVERY, help="H of each run")
    parser.add_argument("--out", type=Path, default=Path("docs/diloco_learning.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/diloco_learning.png"))
    args = parser.parse_args()
    done = json.loads(args.out.read_text()) if args.out.exists() else []
    grid = [("every_step", r, 1) for r in args.replicas] + [
        (mode, r, every)
        for mode in args.modes.split(",")
        for r in args.replicas
        for every in args.every
    ]
    for index, (mode, replicas, every) in enumerate(grid, 1):
        if any((d["mode"], d["replicas"], d["every"]) == (mode, replicas, every) for d in done):
            continue  # a restarted script keeps what it has
        print(f"[{index}/{len(grid)}] {mode}, {replicas} replicas, H={every}", flush=True)
        done.append(one_run(mode, replicas, every, args))
        args.out.write_text(json.dumps(done, indent=1) + "\n")
    print(table(done))
    plot(done, args.plot)


if __name__ == "__main__":
    main()
