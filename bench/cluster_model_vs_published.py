"""The cluster model (t5scale simulate) beside published GPU measurements, for docs/cluster_model.md.

    python bench/cluster_model_vs_published.py [--skip-nemo]

Each published row is re-created as closely as t5scale can express it: the same architecture
dimensions (T5 v1.1 = the mT5 presets with T5's 32,128-token vocabulary), GPU count, per-GPU
batch, lengths 512/128 and bf16, on DGX A100 nodes (gin/clusters/a100.gin), with plain data
parallelism (ZeRO stage 0; the t5x runs used TP 1 and no parameter sharding). The model's
compute efficiency is the gin file's assumption (0.4), not fitted to these rows.
Compiling on up to 256 emulated devices takes minutes; analyses are cached (simulate.py).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

import t5scale  # noqa: F401

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 256)

from t5scale.config import build_run_config, build_study_config, parse_gin  # noqa: E402
from t5scale.study.simulate import predict, step_analysis  # noqa: E402

T5X = (
    "NVIDIA/JAX-Toolbox rosetta/rosetta/projects/t5x/README.md @ 12d19d5c (t5x, A100 80G SXM, bf16)"
)
NEMO = "NVIDIA/NeMo-Framework-Launcher README.md @ 003d7e63, mT5 3B scaling (DGX A100 80GB)"
# (label, preset, GPUs, per-GPU batch, published sequences/s)
T5X_ROWS = [
    ("T5 v1.1 small", "mt5_small", 8, 256, 5712),
    ("T5 v1.1 large", "mt5_large", 64, 32, 4853),
    ("T5 v1.1 xl", "mt5_xl", 144, 8, 3021),
    ("T5 v1.1 xl", "mt5_xl", 256, 8, 4322),
]
# nodes → published tokens/s (NeMo mT5 3B, TP 2, distributed Adam; lengths 512/128)
NEMO_ROWS = {1: 91166, 2: 179583, 4: 346263, 5: 429088, 10: 798570, 20: 1303767}


def with_full_overlap(cluster):
    """The same cluster with communication fully hidden behind compute where it can be."""
    return dataclasses.replace(cluster, overlap=1.0)


def run_for(preset: str, vocab: int | None, remat: str = "none"):
    bindings = ["INPUT_LENGTH=512", "TARGET_LENGTH=128", "ModelConfig.dtype='bfloat16'",
                f"ModelConfig.remat='{remat}'"]  # fmt: skip
    if vocab:
        bindings.append(f"ModelConfig.vocab_size={vocab}")
    parse_gin([f"gin/models/{preset}.gin", "gin/clusters/a100.gin"], bindings)
    return build_run_config(), build_study_config("cluster")


def t5x_table() -> list[str]:
    lines = [f"Source: {T5X}.", "",
             "| model | GPUs | batch/GPU | published seq/s | predicted seq/s | error | "
             "predicted, full overlap | error | fits (XLA GB) |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, preset, gpus, micro, published in T5X_ROWS:
        run, cluster = run_for(preset, vocab=32128)
        analysis = step_analysis(run, 0, gpus, micro)
        nodes = gpus // cluster.gpus_per_node
        plain = predict(analysis, cluster, nodes, run.model.remat)
        full = predict(analysis, with_full_overlap(cluster), nodes, run.model.remat)
        predicted, overlapped = plain["tokens_per_s"] / 640, full["tokens_per_s"] / 640
        lines.append(
            f"| {label} | {gpus} | {micro} | {published:,} | {predicted:,.0f} | "
            f"{100 * (predicted / published - 1):+.0f}% | {overlapped:,.0f} | "
            f"{100 * (overlapped / published - 1):+.0f}% | "
            f"{'yes' if plain['fits'] else 'no'} ({plain['xla_peak_bytes'] / 1e9:.0f}) |"
        )
        print(lines[-1], flush=True)
    return lines


def nemo_table() -> list[str]:
    run, cluster = run_for("mt5_xl", vocab=None)
    lines = [f"Source: {NEMO}. Predicted: mt5_xl, ZeRO stage 1 (closest to a distributed "
             "optimizer; t5scale has no TP 2 in the cluster model), batch 24 per GPU.", "",
             "| nodes | published tokens/s | speed-up | predicted tokens/s | speed-up | error | "
             "predicted, full overlap | speed-up | error |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    base_pub = base_pred = base_full = None
    for nodes, published in NEMO_ROWS.items():
        gpus = nodes * cluster.gpus_per_node
        analysis = step_analysis(run, 1, gpus, 24)
        plain = predict(analysis, cluster, nodes, run.model.remat)["tokens_per_s"]
        full = predict(analysis, with_full_overlap(cluster), nodes, run.model.remat)["tokens_per_s"]
        base_pub, base_pred = base_pub or published, base_pred or plain
        base_full = base_full or full
        lines.append(
            f"| {nodes} | {published:,} | {published / base_pub:.2f}× | {plain:,.0f} | "
            f"{plain / base_pred:.2f}× | {100 * (plain / published - 1):+.0f}% | {full:,.0f} | "
            f"{full / base_full:.2f}× | {100 * (full / published - 1):+.0f}% |"
        )
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-nemo", action="store_true")
    args = parser.parse_args()
    lines = t5x_table()
    if not args.skip_nemo:
        lines += ["", *nemo_table()]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
