"""Does FP8 (gin/precision/fp8.gin) learn as mixed precision does? An mt5_small-shaped model on
the shipped corpus, on the CPU, where XLA emulates the float8 types.

    python bench/fp8_learning.py [--steps 300] [--out docs/fp8_learning.json]
        [--plot docs/fp8_learning.png]
    python bench/fp8_learning.py --steps 2 --layers 1 --validate_every 2 \
        --out /tmp/f.json --plot /tmp/f.png   # the script's check

Both runs see the same tokens (span corruption of the shipped corpus, seqio, its 4k-piece
vocabulary) from the same initial parameters, on 2 emulated CPU devices at ZeRO stage 1 with
AdamW; they differ only in the precision file. The model has mt5_small's widths (d_model 512,
d_ff 1024, 6 heads of 64) with fewer layers and the corpus's vocabulary, so that a few hundred
steps take minutes here. The CPU has no FP8 units: XLA computes the quantized products in wider
types, so what this measures is the numerics of the scaling and rounding, not speed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from t5scale import xla_cpu  # noqa: E402

jax.config.update("jax_platforms", "cpu")
xla_cpu.emulate_cpu_devices(2)

from t5scale.config import build_run_config, parse_gin  # noqa: E402
from t5scale.train.loop import train  # noqa: E402

PRECISIONS = ("mixed", "fp8")


def bindings(args) -> list[str]:
    return [
        "ModelConfig.name='mt5_small_widths'", "ModelConfig.vocab_size=4096",
        "ModelConfig.d_model=512", "ModelConfig.d_ff=1024", "ModelConfig.num_heads=6",
        "ModelConfig.d_kv=64", f"ModelConfig.num_encoder_layers={args.layers}",
        f"ModelConfig.num_decoder_layers={args.layers}", "ParallelConfig.zero_stage=1",
        f"TRAIN_STEPS={args.steps}", f"BATCH_SIZE={args.batch_size}", "INPUT_LENGTH=64",
        "TARGET_LENGTH=16", "OptimizerConfig.learning_rate=1e-3", "OptimizerConfig.warmup_steps=30",
        f"DataConfig.validation_every={args.validate_every}", "DataConfig.validation_batches=4",
        "TrainConfig.log_every=25",
    ]  # fmt: skip


def one_run(precision: str, args) -> dict:
    parse_gin(["gin/data/corpus.gin", f"gin/precision/{precision}.gin"], bindings(args))
    run = build_run_config()
    started = time.perf_counter()
    history = train(run)
    validation = [(r.step, r.validation_loss) for r in history if r.validation_loss is not None]
    return {
        "precision": precision,
        "steps": args.steps,
        "layers": args.layers,
        "tokens": run.tokens_per_step * args.steps,
        "train": [(r.step, r.loss) for r in history],
        "validation": validation,
        "final_validation_loss": validation[-1][1],
        "wall_s": time.perf_counter() - started,
    }


def _mean_train_loss(result: dict, last: int) -> float:
    losses = [loss for _, loss in result["train"][-last:]]
    return sum(losses) / len(losses)


def table(results: list[dict]) -> str:
    mixed = next(r for r in results if r["precision"] == "mixed")
    last = max(1, len(mixed["train"]) // 10)
    lines = [
        f"| precision | final validation loss | vs mixed | train loss, mean of the last {last} "
        "steps | vs mixed | wall (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: PRECISIONS.index(r["precision"])):
        delta = r["final_validation_loss"] - mixed["final_validation_loss"]
        train_loss = _mean_train_loss(r, last)
        train_delta = train_loss - _mean_train_loss(mixed, last)
        lines.append(
            f"| {r['precision']} | {r['final_validation_loss']:.4f} | {delta:+.4f} | "
            f"{train_loss:.4f} | {train_delta:+.4f} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        style = "k-" if r["precision"] == "mixed" else "r-"
        steps, losses = zip(*r["train"], strict=True)
        axes[0].plot(steps, losses, style, alpha=0.7, linewidth=0.8, label=r["precision"])
        steps, losses = zip(*r["validation"], strict=True)
        axes[1].plot(steps, losses, style, marker=".", label=r["precision"])
    layers = results[0]["layers"]
    axes[0].set_title(f"train loss (mt5_small widths, {layers}+{layers} layers, 4k vocabulary)")
    axes[1].set_title("validation loss (held-out lines of the shipped corpus)")
    for axis in axes:
        axis.set_xlabel("step (same batches in both runs)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=4, help="encoder and decoder layers each")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--validate_every", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path("docs/fp8_learning.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/fp8_learning.png"))
    args = parser.parse_args()
    done = json.loads(args.out.read_text()) if args.out.exists() else []
    for index, precision in enumerate(PRECISIONS, 1):
        if any(d["precision"] == precision for d in done):
            continue  # a restarted script keeps what it has
        print(f"[{index}/{len(PRECISIONS)}] {precision}", flush=True)
        done.append(one_run(precision, args))
        args.out.write_text(json.dumps(done, indent=1) + "\n")
    print(table(done))
    plot(done, args.plot)


if __name__ == "__main__":
    main()
