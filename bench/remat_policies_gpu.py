"""What each remat policy keeps, on XLA:GPU's program for one H100 compiled without one (mixed
precision, batch 32 of 1024/229, attention 'dot', ZeRO 0): peak memory, kernels and the GPU
path's roofline step, for ModelConfig.remat 'dots' (dots_saveable) against keeping everything
(everything_saveable, or no jax.checkpoint at all: what-ifs this script patches in for itself),
and 'minimal' and 'full'. docs/benchmarks.md, 2026-11-27, "What remat 'dots' keeps".

    python bench/remat_policies_gpu.py mt5_small,mt5_base dots_saveable,everything_saveable,no_checkpoint
    python bench/remat_policies_gpu.py mt5_small,mt5_base minimal:dots_saveable,full:dots_saveable
"""

from __future__ import annotations

import importlib
import sys
import time

importlib.import_module("t5scale")
import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
import flax.linen as nn  # noqa: E402

from t5scale import xla_gpu  # noqa: E402
from t5scale.config import build_hardware, build_run_config, parse_gin  # noqa: E402
from t5scale.model import mt5  # noqa: E402
from t5scale.train.setup import build_setup  # noqa: E402
from t5scale.whatif.gpu_step import predict_program  # noqa: E402
from t5scale.whatif.weak_scaling import weak_scale  # noqa: E402

BATCH, INPUT, TARGET = 32, 1024, 229
original_policy, original_remat = mt5.remat_policy, nn.remat
VARIANTS = {
    "dots_saveable": lambda: None,  # what 'dots' is
    "everything_saveable": lambda: setattr(
        mt5,
        "remat_policy",
        lambda name, unrolled=False: (
            jax.checkpoint_policies.everything_saveable
            if name == "dots"
            else original_policy(name, unrolled)
        ),
    ),
    "no_checkpoint": lambda: setattr(nn, "remat", lambda cls, **kw: cls),
}


def row(model: str, variant: str, remat: str = "dots") -> str:
    mt5.remat_policy, nn.remat = original_policy, original_remat
    VARIANTS[variant]()
    parse_gin(
        [f"gin/models/{model}.gin", "gin/precision/mixed.gin", "gin/clusters/h100.gin"],
        [
            f"ModelConfig.remat='{remat}'",
            "ModelConfig.attention='dot'",
            f"INPUT_LENGTH={INPUT}",
            f"TARGET_LENGTH={TARGET}",
        ],
    )
    cluster = build_hardware()
    devices = xla_gpu.GpuTopology("h100_sxm", 1, 1).devices()
    started = time.process_time()
    step = build_setup(weak_scale(build_run_config(), 0, 1, BATCH), devices).compile()
    cpu_s = time.process_time() - started
    a = step.analysis
    m, k = a.memory_per_device, a.kernels
    t = predict_program(a.program, cluster)
    gb = 1e9
    classes = " | ".join(
        f"{getattr(k, c).count:,} / {(getattr(k, c).bytes_read + getattr(k, c).bytes_written) / gb:,.0f}"
        for c in ("gemm", "fusion", "copy")
    )
    return (
        f"| {model} | {remat} | {variant} | {m.peak_estimate_bytes / gb:.1f} | "
        f"{m.temp_bytes / gb:.1f} | {classes} | {k.kernels:,} | "
        f"{k.gemm.flops / 1e12:,.1f} | {t.step_s * 1e3:,.0f} ms "
        f"({t.compute_by_class_s['gemm'] * 1e3:,.0f} gemm + "
        f"{(t.compute_by_class_s['fusion'] + t.compute_by_class_s['copy']) * 1e3:,.0f} fusion/copy) | "
        f"{cpu_s:.0f} CPU-s |"
    )


if __name__ == "__main__":
    print(
        "| model | remat | policy | peak GB | temp GB | GEMMs n / GB | fusions n / GB | "
        "copies n / GB | kernels | GEMM TFLOP | roofline step | compile |",
        flush=True,
    )
    print("|" + "---|" * 12, flush=True)
    for model in sys.argv[1].split(","):
        for variant in sys.argv[2].split(","):
            remat, _, variant = variant.rpartition(":")
            print(row(model, variant, remat or "dots"), flush=True)
