"""The funnel against timing noise, simulated: how often the truly best configuration survives,
how often it wins, and the device time saved against timing every grid point.

    python bench/funnel_noise.py [--runs 1000] [--out docs/funnel_noise.json]

Not a test (tests/test_study.py runs fewer seeds): the figures of docs/funnel.md. The grid, its
true speeds and the noise model are t5scale/study/simulated.py's; the timing rule and the
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

from t5scale.study import simulated  # noqa: E402

NOISES = (0.05, 0.1, 0.2, 0.3, 0.5)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    noise = [100 * r["noise"] for r in rows]
    figure, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(noise, [100 * r["best_survived"] for r in rows], marker="o",
            label="truly best survives to the last round")  # fmt: skip
    ax.plot(noise, [100 * r["best_won"] for r in rows], marker="s", label="truly best wins")
    ax.plot(noise, [100 * r["saving_mean"] for r in rows], marker="^",
            label="device time saved vs the grid (mean)")  # fmt: skip
    ax.fill_between(noise, [100 * r["saving_min"] for r in rows],
                    [100 * r["saving_max"] for r in rows], alpha=0.15, color="C2",
                    label="saving, min to max over runs")  # fmt: skip
    ax.set_xlabel("per-step timing noise (log-normal σ, %)")
    ax.set_ylabel("%")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(f"Simulated funnel, {rows[0]['runs']} seeded runs per noise level")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "funnel_noise.json")
    args = parser.parse_args()
    rows = []
    for noise in NOISES:
        started = time.perf_counter()
        row = simulated.survival_and_saving(noise, args.runs, grid_runs=20)
        rows.append(row)
        print(f"noise {noise:.0%}: best survived {row['best_survived']:.1%}, won "
              f"{row['best_won']:.1%}, saved {row['saving_mean']:.1%} "
              f"({row['saving_min']:.1%}-{row['saving_max']:.1%}) "
              f"[{time.perf_counter() - started:.0f} s]", flush=True)  # fmt: skip
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
