"""The one-H100 step as XLA:GPU compiles it, without a GPU: memory, score tensors and kernels
per step, for each attention and remat setting (issue 34's measure of the GPU step).

    python bench/gpu_step_compiled.py                       # mt5_small, base, large
    python bench/gpu_step_compiled.py --models mt5_large --remat full
    python bench/gpu_step_compiled.py --layers loop unrolled   # ModelConfig.scan_layers
    python bench/gpu_step_compiled.py --logits float32 bfloat16  # ModelConfig.logits_dtype
    python bench/gpu_step_compiled.py --logits float32 kernel    # ModelConfig.head_kernel

Each step as `t5scale plan` builds it for one H100 (gin/clusters/h100.gin): mixed precision,
batch 32 of 1024/229, ZeRO 0, AdamW. Prints a markdown table: XLA's arguments + temporaries per
device, how many [32, heads, q, k] score tensors the program text holds, and the kernel
inventory per step (loops multiplied out; t5scale/analysis/kernels.py) with the bytes the GEMMs
and the non-GEMM kernels read and write, the cluster model's step for the program on
gin/clusters/h100.gin (t5scale/whatif/gpu_step.py; a prediction, not a measurement), and the
compile time.
"""

from __future__ import annotations

import argparse
import importlib
import re
import time

importlib.import_module("t5scale")  # before jax: where the CUDA plugin has no GPU, quietly

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")

from t5scale import xla_gpu  # noqa: E402
from t5scale.config import build_hardware, build_run_config, parse_gin  # noqa: E402
from t5scale.train.setup import build_setup  # noqa: E402
from t5scale.whatif.gpu_step import predict_program  # noqa: E402
from t5scale.whatif.weak_scaling import weak_scale  # noqa: E402

MODELS = ("mt5_small", "mt5_base", "mt5_large")
BATCH, INPUT, TARGET = 32, 1024, 229


def score_tensors(hlo_text: str) -> int:
    """Arrays shaped like a batch's attention scores, [(layers,) 32, heads, q, k], any dtype."""
    lengths = f"(?:{INPUT}|{TARGET})"
    return len(re.findall(rf"\[(?:\d+,)?{BATCH},\d+,{lengths},{lengths}\]", hlo_text))


def _logits_bindings(logits: str) -> list[str]:
    """'kernel': the head's kernel, which writes no logits (ModelConfig.head_kernel); else the
    dtype XLA's GEMM writes them in."""
    if logits == "kernel":
        return ["ModelConfig.head_kernel=True"]
    return [f"ModelConfig.logits_dtype='{logits}'"]


def row(
    model: str, attention: str, remat: str, layers: str = "loop", logits: str = "float32"
) -> str:
    parse_gin(
        [f"gin/models/{model}.gin", "gin/precision/mixed.gin", "gin/clusters/h100.gin"],
        [f"ModelConfig.remat='{remat}'", f"ModelConfig.attention='{attention}'",
         f"ModelConfig.scan_layers={layers == 'loop'}", *_logits_bindings(logits),
         f"INPUT_LENGTH={INPUT}", f"TARGET_LENGTH={TARGET}"],
    )  # fmt: skip
    devices = xla_gpu.GpuTopology("h100_sxm", nodes=1, gpus_per_node=1).devices()
    started = time.process_time()
    step = build_setup(weak_scale(build_run_config(), 0, 1, BATCH), devices).compile()
    cpu_s = time.process_time() - started
    memory = step.compiled.memory_analysis()
    kernels = step.analysis.kernels
    non_gemm = kernels.fusion.count + kernels.copy.count
    non_gemm_bytes = sum(t.bytes_read + t.bytes_written for t in (kernels.fusion, kernels.copy))
    gemm_bytes = kernels.gemm.bytes_read + kernels.gemm.bytes_written
    predicted = predict_program(step.analysis.program, build_hardware(), 1)
    return (
        f"| {model} | {step.setup.run.model.attention} | {remat} | {layers} | {logits} | "
        f"{memory.argument_size_in_bytes / 1e9:.1f} + {memory.temp_size_in_bytes / 1e9:.1f} = "
        f"{(memory.argument_size_in_bytes + memory.temp_size_in_bytes) / 1e9:.1f} GB | "
        f"{score_tensors(step.compiled.as_text())} | {kernels.gemm.count:,} | "
        f"{kernels.attention.count:,} | {kernels.fusion.count:,} | {kernels.copy.count:,} | "
        f"{non_gemm:,} | {gemm_bytes / 1e9:,.1f} GB | {non_gemm_bytes / 1e9:,.1f} GB | "
        f"{predicted.step_s * 1e3:,.1f} ms | {cpu_s:.0f} CPU-s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--attention", nargs="+", default=["dot", "fused"])
    parser.add_argument("--remat", nargs="+", default=["dots", "full"])
    parser.add_argument("--layers", nargs="+", default=["loop"], choices=["loop", "unrolled"])
    parser.add_argument("--logits", nargs="+", default=["float32"],
                        choices=["float32", "bfloat16", "kernel"],
                        help="ModelConfig.logits_dtype: the dtype the head's GEMM writes; "
                             "kernel: ModelConfig.head_kernel, none written")  # fmt: skip
    args = parser.parse_args()
    print(
        "| model | attention | remat | layers | logits | arguments + temporaries | score tensors | "
        "GEMMs | "
        "attention kernels | fusions | copies | non-GEMM | GEMM bytes | non-GEMM bytes | "
        "predicted step (h100.gin) | compile |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    for model in args.models:
        for remat in args.remat:
            for attention in args.attention:
                for layers in args.layers:
                    for logits in args.logits:
                        print(row(model, attention, remat, layers, logits), flush=True)


if __name__ == "__main__":
    main()
