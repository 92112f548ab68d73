"""The seed study's grid, predicted by the cluster model: mT5 base, large, xl and xxl on 1, 2, 4
and 8 DGX A100 and DGX H100 nodes, ZeRO stages 1-3, mixed precision, full remat; with --fp8 the
H100s in fp8 too (gin/precision/fp8.gin: the layers' GEMMs in FP8, priced at the FP8 peak).

    python bench/seed_study_predicted.py [--fp8] [--plot docs/cluster_model_seed_study.png]
    python bench/seed_study_predicted.py --models mt5_tiny --nodes 1 --stages 1 --fp8 \
        --plot /tmp/s.png                                  # the script's check: three programs

Runs `t5scale simulate` in-process for each model and cluster (lengths 1024/229, 4 sequences
per GPU) and prints one markdown table per model and a plot of seconds per step against nodes
per stage, as the seed paper plotted (dashed: the same without overlap, the bound). Where jax's
CUDA plugin is installed, each program is XLA:GPU's for that cluster's GPUs (96 of them; the
A100's and the H100's are compiled apart, two at a time); the bound without overlap reuses them.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import jax

from t5scale import xla_cpu  # noqa: E402

jax.config.update("jax_platforms", "cpu")
xla_cpu.emulate_cpu_devices(64)

from t5scale.config import build_run_config, build_study_config, parse_gin  # noqa: E402
from t5scale.whatif.simulate import (  # noqa: E402
    Simulation,
    format_simulation,
    simulate,
    with_overlap,
)

MODELS = ("mt5_base", "mt5_large", "mt5_xl", "mt5_xxl")
CLUSTERS = ("a100", "h100")
FP8 = "h100 fp8"  # the H100s in fp8 precision (the A100 has no FP8 tensor cores)


def _gin(cluster: str) -> tuple[str, str]:
    """(cluster file, precision file) of a column."""
    return cluster.split()[0], "fp8" if cluster == FP8 else "mixed"


def predict_grid(
    attention: str = "auto",
    models: tuple[str, ...] = MODELS,
    extra: tuple[str, ...] = (),
    clusters: tuple[str, ...] = CLUSTERS,
) -> dict[tuple[str, str], Simulation]:
    """Each cluster's models in a thread of its own: one compiles while the other traces and
    reads its programs in Python (XLA's optimisation passes use one core). Each thread keeps
    its own XLA kernel cache (t5scale/xla_gpu.py), so it reuses its own kernels as before."""
    configured = {}
    for model in models:
        for cluster in clusters:  # gin is global: read every configuration before the threads
            hardware, precision = _gin(cluster)
            parse_gin([f"gin/models/{model}.gin", f"gin/clusters/{hardware}.gin",
                       f"gin/precision/{precision}.gin"],
                      ["ModelConfig.remat='full'", f"ModelConfig.attention='{attention}'",
                       *extra])  # fmt: skip
            run, hardware = build_run_config(), build_study_config("cluster")
            configured[model, cluster] = (run, hardware, build_study_config("simulate"))

    def predict_cluster(cluster: str) -> dict[tuple[str, str], Simulation]:
        done = {}
        for model in models:
            done[model, cluster] = simulate(*configured[model, cluster], show=lambda _: None)
            print(f"{model} on {cluster}: done", flush=True)
        return done

    with ThreadPoolExecutor(len(clusters)) as pool:
        parts = list(pool.map(predict_cluster, clusters))
    return {key: part[key] for key in configured for part in parts if key in part}


def plot(
    results: dict[tuple[str, str], Simulation],
    bound: dict[tuple[str, str], Simulation],
    path: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(model for model, _ in results))
    clusters = list(dict.fromkeys(cluster for _, cluster in results))
    figure, axes = plt.subplots(len(clusters), len(models), figsize=(15, 3.5 * len(clusters)),
                                sharex=True, squeeze=False)  # fmt: skip
    for row, cluster in enumerate(clusters):
        for column, model in enumerate(models):
            ax = axes[row][column]
            rows, highest = results[model, cluster].rows, 0.0
            for stage in sorted({r.stage for r in rows}):
                mine = [r for r in rows if r.stage == stage]
                fits = [r.prediction.fits for r in mine]
                line = ax.plot([r.nodes for r in mine], [r.prediction.step_s for r in mine], marker="o",
                               label=f"ZeRO {stage}" + ("" if all(fits) else " (○: does not fit)"))  # fmt: skip
                for r in mine:
                    if not r.prediction.fits:
                        ax.plot(r.nodes, r.prediction.step_s, "o", color="white", markersize=4)
                unhidden = [r for r in bound[model, cluster].rows if r.stage == stage]
                ax.plot([r.nodes for r in unhidden], [r.prediction.step_s for r in unhidden], "--",
                        color=line[0].get_color(), linewidth=1)  # fmt: skip
                highest = max(highest, *(r.prediction.step_s for r in mine + unhidden))
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
            ax.set_title(f"{model}, DGX {cluster.upper()}", fontsize=10)
            ax.set_ylim(0, 1.12 * highest)
            if column == 0:
                ax.set_ylabel("seconds per step (predicted)")
            if row == len(clusters) - 1:
                ax.set_xlabel("nodes (8 GPUs each)")
            ax.legend(fontsize=7)
    precision = "mixed precision" + ("; FP8: the layers' GEMMs in FP8" if FP8 in clusters else "")
    figure.suptitle(f"t5scale simulate: {precision}, full remat, 4 × 1024/229 sequences per GPU "
                    "(weak scaling); dashed: no overlap")  # fmt: skip
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def pivot(results: dict[tuple[str, str], Simulation]) -> str:
    """Seconds per step by model and stage (rows) and cluster and nodes (columns); * marks a
    configuration whose XLA peak does not fit the GPU's memory."""
    models = list(dict.fromkeys(model for model, _ in results))
    clusters = list(dict.fromkeys(cluster for _, cluster in results))
    nodes = results[models[0], clusters[0]].rows
    counts = sorted({r.nodes for r in nodes})
    header = " | ".join(f"{c.upper()} ×{n}" for c in clusters for n in counts)
    lines = [f"| model | stage | {header} |", "|---|---|" + "---|" * len(clusters) * len(counts)]
    for model in models:
        for stage in sorted({r.stage for r in nodes}):
            cells = []
            for cluster in clusters:
                for row in results[model, cluster].rows:
                    if row.stage == stage:
                        predicted = row.prediction
                        cells.append(f"{predicted.step_s:.3f}{'' if predicted.fits else '*'}")
            lines.append(f"| {model} | {stage} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", default="docs/cluster_model_seed_study.png")
    parser.add_argument("--attention", choices=["dot", "fused", "auto"], default="auto",
                        help="ModelConfig.attention of the predicted steps (docs/attention.md)")  # fmt: skip
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--nodes", type=int, nargs="+", help="default: SimulateConfig's")
    parser.add_argument("--stages", type=int, nargs="+", help="default: SimulateConfig's")
    parser.add_argument("--fp8", action="store_true", help="the H100s in fp8 precision too")
    args = parser.parse_args()
    clusters = (*CLUSTERS, FP8) if args.fp8 else CLUSTERS
    extra = [f"SimulateConfig.{name}={getattr(args, name)}" for name in ("nodes", "stages")
             if getattr(args, name)]  # fmt: skip
    started = time.perf_counter()
    results = predict_grid(args.attention, tuple(args.models), tuple(extra), clusters)
    bound = {key: with_overlap(result, overlap=False) for key, result in results.items()}
    print("\n" + pivot(results))
    for key in ((model, cluster) for cluster in clusters for model in args.models):
        print("\n" + format_simulation(results[key]))
    plot(results, bound, args.plot)
    print(f"\nplot: {args.plot}; {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
