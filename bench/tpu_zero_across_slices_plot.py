"""The TPU seed study's mt5_large before and after ZeRO across slices was mended (issue 60):
docs/tpu_zero_across_slices.json (its provenance inside) → docs/tpu_zero_across_slices.png.

    python bench/tpu_zero_across_slices_plot.py [--data JSON] [--out PNG]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

DATA = Path("docs/tpu_zero_across_slices.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, help="the PNG (default: beside --data)")
    args = parser.parse_args()
    plot(json.loads(args.data.read_text()), args.out or args.data.with_suffix(".png"))


def plot(data: dict, out: Path) -> None:
    slices = data["slices"]
    pods = [name for name in data if name.startswith("v5")]
    figure, axes = plt.subplots(1, len(pods), figsize=(11, 4))
    for ax, pod in zip(axes, pods, strict=True):
        for stage, after in data[pod]["after"].items():
            before = data[pod]["before"][stage]
            color = f"C{int(stage)}"
            ax.plot(slices, after, marker="o", color=color, label=f"ZeRO {stage}")
            shown = [(n, t) for n, t, a in zip(slices, before, after, strict=True) if t != a]
            if shown:
                ax.plot(*zip(*shown, strict=True), marker="x", linestyle="none", color=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(slices, [str(n) for n in slices])
        ax.set_xlabel(f"{pod} slices (over DCN)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"mt5_large on {pod} (×: before, where it differs)", fontsize=10)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("seconds per step (TPU path, unvalidated)")
    figure.suptitle("ZeRO across TPU slices, mended: stage 2 moves what ZeRO says")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
