"""The seed study's question on TPU pods, by the TPU path of `t5scale simulate`: mT5 small,
large, xl and xxl, ZeRO stages 0-3, on 1, 2 and 4 slices of a v5p and of a v5e pod.

    python bench/tpu_seed_study.py --generation v5p [--plot docs/tpu_seed_study_v5p.png]
    python bench/tpu_seed_study.py --generation v5e --slice v5e-8 --counts 1 --models mt5_tiny \
        --out /tmp/t.json --plot /tmp/t.png             # the script's check: 4 programs

Does stage 2 beat stage 3 across slices (over DCN) as the seed study found across nodes, and
which stage fits where? Mixed precision, remat full, 4 sequences of 1024/229 per chip (weak
scaling), as bench/seed_study_predicted.py has the GPU clusters. Each step is compiled by
XLA:TPU for the slices' chips (the `tpu` extra; analyses cached, so a second run compiles
nothing) and timed from its program (t5scale/whatif/tpu_step.py: unvalidated, a roofline lower
bound). A stage whose ZeRO formula alone exceeds the chip's HBM is not compiled ("–").
Results go to runs/tpu_seed_study_<generation>.json (or --out) as each model finishes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from t5scale.startup import start_jax  # first: JAX on the CPU, quietly, with libtpu here

start_jax()

from t5scale.analysis.memory import dcn_program_bytes  # noqa: E402
from t5scale.config import build_hardware, build_run_config, parse_gin  # noqa: E402
from t5scale.train.setup import build_setup  # noqa: E402
from t5scale.whatif.simulate import SimulateConfig, simulate  # noqa: E402
from t5scale.whatif.tpu_pod import TpuPodConfig  # noqa: E402
from t5scale.whatif.weak_scaling import weak_scale  # noqa: E402

MODELS = ("mt5_small", "mt5_large", "mt5_xl", "mt5_xxl")
SLICES = {"v5p": "v5p-128", "v5e": "v5e-64"}  # 64 chips each: a 4x4x4 cube, an 8x8 torus
COUNTS = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class Grid:
    """The study's slices: SLICES[generation] and COUNTS unless told."""

    generation: str
    slice: str
    counts: tuple[int, ...] = COUNTS


def shown_models(rows: list[dict]) -> list[str]:
    """The models the rows have, MODELS' first in their order."""
    found = {r["model"] for r in rows}
    return [m for m in dict.fromkeys([*MODELS, *(r["model"] for r in rows)]) if m in found]


def predict(grid: Grid, model: str) -> list[dict]:
    """One row per stage and slice count: the prediction, or why there is none."""
    parse_gin([f"gin/models/{model}.gin", "gin/precision/mixed.gin",
               f"gin/clusters/tpu_{grid.generation}.gin"],
              ["ModelConfig.dtype='bfloat16'", "ModelConfig.remat='full'", "DATA_SOURCE='synthetic'",
               f"TpuPodConfig.slice='{grid.slice}'"])  # fmt: skip
    run, pod = build_run_config(), build_hardware(required=True)
    rows = []
    for stage in range(4):
        for count in grid.counts:
            config = SimulateConfig(nodes=(count,), stages=(stage,), micro_batch_size=4)
            started = time.perf_counter()
            if (state := model_state_per_chip(run, pod, stage, count)) > pod.device_memory_gb * 1e9:
                rows.append({"model": model, "stage": stage, "slices": count, "refused": state})
                print(f"{model} stage {stage} × {count}: not compiled (ZeRO formula "
                      f"{state / 1e9:.0f} GB a chip)", flush=True)  # fmt: skip
                continue
            result = simulate(run, pod, config, show=lambda _: None)
            if result.refused:  # XLA:TPU refused the program for memory
                said = result.refused[0].refusal.words
                rows.append({"model": model, "stage": stage, "slices": count, "failed": said})
                print(f"{model} stage {stage} × {count}: does not fit: {said}", flush=True)
                continue
            row = result.rows[0]
            predicted = row.prediction
            dcn = dcn_program_bytes(row.analysis.collective_ops)
            rows.append({"model": model, "stage": stage, "slices": count, "chips": row.devices,
                         "dcn_bytes_per_chip": dcn.total,
                         "peak_bytes_per_chip": row.analysis.memory_per_device.peak_estimate_bytes,
                         **dataclasses.asdict(predicted)})  # fmt: skip
            print(f"{model} stage {stage} × {count}: {predicted.step_s:.3f} s "
                  f"({'fits' if predicted.fits else 'does not fit'}; "
                  f"{time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    return rows


def model_state_per_chip(run, pod: TpuPodConfig, stage: int, slices: int) -> float:
    """The ZeRO formula's bytes a chip, as simulate would lay the run (no compile)."""
    target = pod.group_target(slices)
    form = build_setup(
        weak_scale(run, stage, target.size, 4, dcn_groups=target.dcn_groups), target
    ).form
    return form.model_state_bytes().per_device(form.layout.stage, form.layout.zero_size).total


def table(rows: list[dict], grid: Grid) -> str:
    """Seconds per step by model and stage (rows) and slice count (columns); * marks a step
    whose XLA peak exceeds the chip's HBM, – one not compiled (its ZeRO formula alone does),
    "failed" one XLA:TPU refused to compile."""
    lines = [f"| model | stage | {' | '.join(f'{grid.slice} ×{n}' for n in grid.counts)} |",
             "|---|---|" + "---|" * len(grid.counts)]  # fmt: skip
    for model in shown_models(rows):
        for stage in range(4):
            cells = []
            for count in grid.counts:
                found = [
                    r
                    for r in rows
                    if (r["model"], r["stage"], r["slices"]) == (model, stage, count)
                ]
                if not found:
                    cells.append("")
                elif "refused" in found[0]:
                    cells.append("–")
                elif "failed" in found[0]:
                    cells.append("does not fit")
                else:
                    cells.append(f"{found[0]['step_s']:.3f}{'' if found[0]['fits'] else '*'}")
            lines.append(f"| {model} | {stage} | {' | '.join(cells)} |")
    return "\n".join(lines)


def plot(rows: list[dict], grid: Grid, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    models = shown_models(rows)
    figure, axes = plt.subplots(1, len(models), figsize=(15, 3.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for stage in range(4):
            mine = [
                r for r in rows if r["model"] == model and r["stage"] == stage and "step_s" in r
            ]
            if not mine:
                continue
            ax.plot([r["slices"] for r in mine], [r["step_s"] for r in mine], marker="o",
                    color=f"C{stage}", label=f"ZeRO {stage}")  # fmt: skip
            for r in mine:
                if not r["fits"]:
                    ax.plot(r["slices"], r["step_s"], "o", color="white", markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(grid.counts), [str(n) for n in grid.counts])
        ax.set_title(f"{model}, {grid.slice} slices", fontsize=10)
        ax.set_xlabel("slices (over DCN)")
        ax.set_ylim(bottom=0)
        if ax.lines:
            ax.legend(fontsize=7, title="○: does not fit", title_fontsize=7)
    axes[0][0].set_ylabel("seconds per step (TPU path, unvalidated)")
    figure.suptitle(f"t5scale simulate on TPU {grid.generation}: mixed precision, remat full, 4 × "
                    "1024/229 sequences per chip (weak scaling)")  # fmt: skip
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--generation", choices=sorted(SLICES), default="v5p")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--plot", help="a PNG of seconds per step against slices, per model")
    parser.add_argument("--slice", help="the slice (default: the generation's 64 chips)")
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)), help="slice counts")
    parser.add_argument("--out", type=Path, help="default: runs/tpu_seed_study_<generation>.json")
    args = parser.parse_args()
    counts = tuple(int(n) for n in args.counts.split(","))
    grid = Grid(args.generation, args.slice or SLICES[args.generation], counts)
    out = args.out or Path(f"runs/tpu_seed_study_{args.generation}.json")
    out.parent.mkdir(exist_ok=True)
    rows = json.loads(out.read_text()) if out.exists() else []
    started = time.perf_counter()
    for model in args.models.split(","):
        rows = [r for r in rows if r["model"] != model] + predict(grid, model)
        out.write_text(json.dumps(rows, indent=1))
    print("\n" + table(rows, grid))
    if args.plot:
        plot(rows, grid, args.plot)
    print(f"\n{out}; {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
