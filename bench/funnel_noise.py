"""The funnel against timing noise, simulated: how often the truly best configuration survives,
how often it wins, and the device time saved against timing every grid point.

    python bench/funnel_noise.py [--runs 500] [--out docs/funnel_noise.json]
    python bench/funnel_noise.py --runs 1 --grid-runs 1 --step-noises 0.1 --out /tmp/f.json

Not a test (tests/test_study.py runs fewer seeds): the figures of docs/funnel.md. The grid, its
true speeds and the noise model are t5scale/study/known_speeds.py's; the timing rule and the
pruning are the study's own (t5scale/study/evidence.py, funnel.py), at their defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from t5scale.study import known_speeds  # noqa: E402

STEP_NOISES = (0.05, 0.1, 0.2, 0.3, 0.5)
TRIAL_NOISES = (0.0, known_speeds.TRIAL_NOISE)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(TRIAL_NOISES), figsize=(11, 3.8), sharey=True)
    for ax, trial in zip(axes, TRIAL_NOISES, strict=True):
        mine = [r for r in rows if r["trial_noise"] == trial]
        noise = [100 * r["step_noise"] for r in mine]
        ax.plot(noise, [100 * r["best_survived"] for r in mine], marker="o",
                label="truly best survives to the last round")  # fmt: skip
        ax.plot(noise, [100 * r["best_won"] for r in mine], marker="s", label="truly best wins")
        ax.plot(noise, [100 * r["saving_mean"] for r in mine], marker="^",
                label="device time saved vs the grid (mean)")  # fmt: skip
        ax.fill_between(noise, [100 * r["saving_min"] for r in mine],
                        [100 * r["saving_max"] for r in mine], alpha=0.15, color="C2",
                        label="saving, min to max over runs")  # fmt: skip
        ax.set_xlabel("per-step timing noise (log-normal σ, %)")
        ax.set_title(f"per-trial noise {100 * trial:.0f}%")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("%")
    axes[0].legend(fontsize=8, loc="lower left")
    figure.suptitle(f"Simulated funnel, {rows[0]['runs']} seeded runs per point, 99% confidence")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--grid-runs", type=int, default=20, help="grids drawn for the saving")
    parser.add_argument("--step-noises", type=float, nargs="+", default=STEP_NOISES)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "funnel_noise.json")
    args = parser.parse_args()
    rows = []
    for trial in TRIAL_NOISES:
        for step in args.step_noises:
            started = time.perf_counter()
            noise = known_speeds.Noise(step, trial)
            row = known_speeds.survival_and_saving(noise, args.runs, args.grid_runs)
            rows.append(row)
            print(f"noise {step:.0%} per step, {trial:.0%} per trial: best survived "
                  f"{row['best_survived']:.1%}, won "
                  f"{row['best_won']:.1%}, saved {row['saving_mean']:.1%} "
                  f"({row['saving_min']:.1%}-{row['saving_max']:.1%}) "
                  f"[{time.perf_counter() - started:.0f} s]", flush=True)  # fmt: skip
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
