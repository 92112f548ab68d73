"""The cluster model (t5scale simulate) beside published multi-GPU T5/mT5 measurements.

    python bench/cluster_model_vs_published.py --calibrate   # the one fitted figure
    python bench/cluster_model_vs_published.py               # the validation table
    python bench/cluster_model_vs_published.py --small       # the script's check: mt5_tiny

Every published row is re-created as closely as t5scale can express it, with the run's own
architecture, GPU count, tensor parallelism, per-rank batch, gradient accumulation, lengths
512/128, bf16 compute and the precision the framework keeps, on DGX A100 nodes
(gin/clusters/a100.gin). Nothing in the model is fitted to these rows: its one calibrated
figure, `ClusterConfig.roofline_fraction`, comes from t5scale's own one-H100 steps
(`--calibrate`, docs/benchmarks.md of 2026-11-23). Each row is predicted
with overlap from the step's structure (the model) and with nothing hidden (the bound).
Compiles on up to 512 emulated devices; analyses are cached (t5scale/whatif/compile.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

import jax

from t5scale import xla_cpu  # noqa: E402

jax.config.update("jax_platforms", "cpu")
xla_cpu.emulate_cpu_devices(512)

from t5scale.config import build_run_config, build_study_config, parse_gin  # noqa: E402
from t5scale.whatif.compile import cached_analysis  # noqa: E402
from t5scale.whatif.gpu_step import predict_program  # noqa: E402
from t5scale.whatif.step_time import predict, predict_from_program  # noqa: E402
from t5scale.whatif.weak_scaling import weak_scale  # noqa: E402

T5X = "NVIDIA/JAX-Toolbox rosetta/rosetta/projects/t5x/README.md @ 12d19d5c"
NEMO = "NVIDIA/NeMo-Framework-Launcher README.md @ 003d7e63"
T5_VOCAB = 32128


@dataclasses.dataclass(frozen=True)
class Published:
    """One published throughput and how its run was configured."""

    source: str
    label: str
    preset: str
    vocab: int | None  # None: the preset's (mT5's 250,112)
    gpus: int
    tensor: int
    per_rank: int  # sequences per data-parallel rank per micro-batch
    micro_batches: int
    stage: int
    precision: str  # t5scale's PrecisionConfig bindings for what the framework keeps
    sequences_per_s: float


def _t5x(label, preset, gpus, tensor, per_gpu, published):
    # t5x: AdamW, fp32 parameters and gradients with bf16 activations, plain data parallelism
    # (TP 1: ZeRO stage 0); GBS = GPUs × BS/GPU / TP, no accumulation.
    return Published(T5X, label, preset, T5_VOCAB, gpus, tensor, per_gpu, 1, 0,
                     "PrecisionConfig.mode='float32'", published)  # fmt: skip


def _nemo(label, preset, vocab, nodes, tokens_per_s):
    # NeMo 3B presets (conf/training/{t5,mt5}/3b.yaml): TP 2, micro-batch 24, global batch 1920
    # (accumulated to on fewer nodes), distributed Adam with fp32 gradient reduction (Megatron's
    # default for bf16): ZeRO stage 1 here, mixed precision reducing in fp32. Published tokens/s
    # count the 512 encoder positions of each sequence (the table's "Seq Length").
    ranks = nodes * 8 // 2
    return Published(NEMO, label, preset, vocab, nodes * 8, 2, 24, 1920 // (ranks * 24), 1,
                     "PrecisionConfig.mode='mixed' PrecisionConfig.reduce_dtype='float32'",
                     tokens_per_s / 512)  # fmt: skip


ROWS = [
    _t5x("T5 v1.1 small", "mt5_small", 8, 1, 256, 5712),
    _t5x("T5 v1.1 large", "mt5_large", 64, 1, 32, 4853),
    _t5x("T5 v1.1 xl", "mt5_xl", 144, 1, 8, 3021),
    _t5x("T5 v1.1 xl", "mt5_xl", 256, 1, 8, 4322),
    *(_nemo("mT5 3B", "mt5_xl", None, n, t) for n, t in
      ((1, 91166), (2, 179583), (4, 346263), (5, 429088), (10, 798570), (20, 1303767))),
    *(_nemo("T5 3B", "mt5_xl", T5_VOCAB, n, t) for n, t in
      ((1, 110769), (2, 215579), (4, 417644), (5, 515100), (10, 957506), (20, 1626353))),
    _t5x("T5 v1.1 xxl", "mt5_xxl", 512, 8, 36, 1887),
]  # fmt: skip


# t5scale on one H100, 2026-11-23 (docs/benchmarks.md): batch 32, lengths 1024/229, bf16
# compute with fp32 parameters and AdamW; (preset, remat, measured seconds per step). 'dots'
# was then named 'none'.
OWN_H100_STEPS = [("mt5_small", "dots", 0.114), ("mt5_base", "full", 0.254),
                  ("mt5_large", "full", 0.672)]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Scale:
    """The rows' and the calibration's models and lengths: as published, or --small's."""

    rows: list[Published]
    own_steps: list[tuple[str, str, float]]
    lengths: tuple[int, int]  # the rows' inputs and targets
    calibration_lengths: tuple[int, int] = (1024, 229)


PUBLISHED = Scale(ROWS, OWN_H100_STEPS, (512, 128))
# --small checks the script, not the model: mt5_tiny at short lengths in place of each model,
# on the first t5x row and the first NeMo row, and the first own step with --calibrate.
SMALL = Scale(
    [dataclasses.replace(row, preset="mt5_tiny", vocab=None) for row in (ROWS[0], ROWS[4])],
    [("mt5_tiny", remat, measured) for _, remat, measured in OWN_H100_STEPS[:1]],
    (32, 8),
    (32, 8),
)


def analysis_for(run, cluster, stage: int, gpus: int, per_rank: int, tensor: int, path: str):
    """The step compiled by XLA's CPU compiler on emulated devices, or by its GPU compiler for
    the cluster's GPUs (cached by simulate)."""
    target = cluster.target(gpus, path)
    staged = weak_scale(run, stage, gpus, per_rank, tensor=tensor, dcn_groups=target.dcn_groups)
    return cached_analysis(staged, target)


def predict_on(path: str, analysis, model, cluster, overlap: bool = True):
    if path == "gpu":
        return predict_from_program(analysis, model, cluster, overlap)
    return predict(analysis, model, cluster, overlap)


def calibrate(path: str, scale: Scale) -> None:
    """The roofline fraction each own H100 step implies, and their geometric mean. The GPU
    path's roofline is each kernel's; its launches are not scaled."""
    fractions = []
    inputs, targets = scale.calibration_lengths
    for preset, remat, measured in scale.own_steps:
        parse_gin([f"gin/models/{preset}.gin", "gin/clusters/h100.gin"],
                  [f"INPUT_LENGTH={inputs}", f"TARGET_LENGTH={targets}",
                   "ModelConfig.dtype='bfloat16'",
                   f"ModelConfig.remat='{remat}'", "PrecisionConfig.mode='float32'",
                   "ClusterConfig.roofline_fraction=1.0", ATTENTION])  # fmt: skip
        run, cluster = build_run_config(), build_study_config("cluster")
        analysis = analysis_for(run, cluster, 0, 1, 32, 1, path)
        predicted = predict_on(path, analysis, run.model, cluster)
        fixed = predicted.update_s
        if path == "gpu":
            fixed = predict_program(analysis.program, cluster, 1).launch_s
        fraction = (predicted.compute_s + predicted.update_s - fixed) / (measured - fixed)
        fractions.append(fraction)
        print(f"{preset} (remat {remat}), {path} path: measured {measured:.3f} s, roofline "
              f"compute {predicted.compute_s:.3f} s + update {predicted.update_s:.4f} s: "
              f"fraction {fraction:.3f}", flush=True)  # fmt: skip
    mean = math.exp(statistics.fmean(math.log(f) for f in fractions))
    print(f"{path} path: fraction {mean:.2f} (geometric mean of {len(fractions)})")


# What the rows' frameworks and t5scale's own measured steps ran: attention scores formed in
# memory, the softmax fused (t5x's XLA einsums; NeMo's `masked_softmax_fusion: True`, Megatron's
# fused scaled-masked-softmax kernel, in conf/training/t5/3b.yaml; t5scale's H100 steps of
# 2026-11-23 with 'dot'), not a flash-attention kernel: so 'dot', whatever the default.
ATTENTION = "ModelConfig.attention='dot'"


def run_for(row: Published, lengths: tuple[int, int]):
    bindings = [f"INPUT_LENGTH={lengths[0]}", f"TARGET_LENGTH={lengths[1]}",
                "ModelConfig.dtype='bfloat16'",
                "ModelConfig.remat='dots'", f"TrainConfig.micro_batches={row.micro_batches}",
                ATTENTION, *row.precision.split()]  # fmt: skip
    if row.vocab:
        bindings.append(f"ModelConfig.vocab_size={row.vocab}")
    parse_gin([f"gin/models/{row.preset}.gin", "gin/clusters/a100.gin"], bindings)
    return build_run_config(), build_study_config("cluster")


def row_line(row: Published, scale: Scale, compiler: str) -> tuple[str, float]:
    """The row's line of the table, and the model's error against the published figure."""
    run, cluster = run_for(row, scale.lengths)
    analysis = analysis_for(run, cluster, row.stage, row.gpus, row.per_rank, row.tensor, compiler)
    model = predict_on(compiler, analysis, run.model, cluster, overlap=True)
    bound = predict_on(compiler, analysis, run.model, cluster, overlap=False)
    error = model.sequences_per_s / row.sequences_per_s - 1
    source = "t5x" if row.source == T5X else "NeMo"
    line = (
        f"| {source} | {row.label} | {row.gpus} | {row.tensor} | {row.per_rank} × "
        f"{row.micro_batches} | {row.sequences_per_s:,.0f} | {model.sequences_per_s:,.0f} | "
        f"{100 * error:+.0f}% | {bound.sequences_per_s:,.0f} | "
        f"{100 * (bound.sequences_per_s / row.sequences_per_s - 1):+.0f}% | "
        f"{model.compute_s:.3f} | {model.exposed_communication_s:.3f} | "
        f"{'yes' if model.fits else 'no'} ({model.xla_peak_bytes / 1e9:.0f}) |"
    )
    return line, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibrate", action="store_true", help="fit roofline_fraction only")
    parser.add_argument(
        "--compiler", choices=("cpu", "gpu"), default="cpu",
        help="the CPU path (emulated devices) or the GPU path (XLA:GPU's program; gpu-compile)",
    )  # fmt: skip
    parser.add_argument("--small", action="store_true", help="mt5_tiny on two rows: a check")
    args = parser.parse_args()
    scale = SMALL if args.small else PUBLISHED
    if args.calibrate:
        calibrate(args.compiler, scale)
        return
    lines = [
        "| source | model | GPUs | TP | batch/rank × accumulation | published seq/s | "
        "predicted seq/s | error | no overlap | error | compute s | exposed comm. s | "
        "fits (XLA GB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors: dict[str, list[float]] = {}
    started = time.perf_counter()
    for row in scale.rows:
        line, error = row_line(row, scale, args.compiler)
        errors.setdefault(row.source, []).append(error)
        lines.append(line)
        print(lines[-1], file=sys.stderr, flush=True)  # progress
    every = [abs(e) for found in errors.values() for e in found]
    lines += ["", "| rows | median absolute error | worst |", "|---|---|---|"]
    for label, found in [*errors.items(), ("all", every)]:
        magnitudes = [abs(e) for e in found]
        lines.append(f"| {'t5x' if label == T5X else 'NeMo' if label == NEMO else label} "
                     f"({len(found)}) | {100 * statistics.median(magnitudes):.0f}% | "
                     f"{100 * max(magnitudes):.0f}% |")  # fmt: skip
    print("\n".join(lines))
    print(
        f"{args.compiler} path, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True
    )


if __name__ == "__main__":
    main()
