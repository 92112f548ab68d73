"""XLA:GPU's memory per device beside XLA:CPU's, at real sizes: the seed study's steps compiled
for DGX H100 nodes without a GPU, and for as many emulated CPU devices.

    python bench/gpu_memory.py                  # mt5_small … mt5_xxl, 1-8 nodes, stages 1-3
    python bench/gpu_memory.py --no-cpu         # the GPU compiler only
    python bench/gpu_memory.py --models mt5_xl --nodes 1 2

Settings as bench/seed_study_predicted.py: mixed precision, full remat, 4 sequences of 1024/229
per GPU, AdamW, ZeRO over every GPU. Each program is compiled once (t5scale/whatif/simulate.py's
cache: `simulate` then reuses it); a cached program reports the compile time it took when it
was made. Prints a markdown table and the wall time of the whole grid.
"""

from __future__ import annotations

import argparse
import importlib
import time

importlib.import_module("t5scale")  # before jax: where the CUDA plugin has no GPU, quietly

import jax  # noqa: E402

from t5scale import xla_cpu  # noqa: E402

jax.config.update("jax_platforms", "cpu")
xla_cpu.emulate_cpu_devices(64)

from t5scale.config import build_run_config, build_study_config, parse_gin  # noqa: E402
from t5scale.whatif.compile import cached_analysis  # noqa: E402
from t5scale.whatif.weak_scaling import weak_scale  # noqa: E402

MODELS = ("mt5_small", "mt5_base", "mt5_large", "mt5_xl", "mt5_xxl")
GB = 1e9


def memory_cells(analysis) -> str:
    memory = analysis.memory_per_device
    return (
        f"{memory.argument_bytes / GB:.1f} + {memory.temp_bytes / GB:.1f} = "
        f"{memory.peak_estimate_bytes / GB:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--nodes", nargs="+", type=int, default=(1, 2, 4, 8))
    parser.add_argument("--stages", nargs="+", type=int, default=(1, 2, 3))
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU compiler's column")
    # 'dot' by default: the CPU compiler only has the einsum attention ('auto' is 'dot' there),
    # so both columns are then the same program; 'auto' gives the GPU its fused kernel.
    parser.add_argument("--attention", choices=["dot", "auto"], default="dot")
    args = parser.parse_args()
    lines = [
        "| model | nodes | stage | XLA:GPU GB/GPU (arguments + temp = peak) | compile s | "
        "XLA:CPU GB/device (same) | compile s | GPU kernels per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    started = time.perf_counter()
    for model in args.models:
        # mixed precision: PrecisionConfig.mode "auto" with bf16 compute, as seed_study_predicted.py
        # (with --attention auto, the same cache keys: `simulate` there reuses these programs)
        parse_gin([f"gin/models/{model}.gin", "gin/clusters/h100.gin"],
                  ["ModelConfig.dtype='bfloat16'", "ModelConfig.remat='full'",
                   f"ModelConfig.attention='{args.attention}'"])  # fmt: skip
        run, cluster = build_run_config(), build_study_config("cluster")
        budget = int(cluster.device_memory_gb * GB)
        for nodes in args.nodes:
            gpus = nodes * cluster.gpus_per_node
            for stage in args.stages:
                target = cluster.target(gpus, "gpu")
                staged = weak_scale(run, stage, gpus, 4, dcn_groups=target.dcn_groups)
                gpu = cached_analysis(staged, target, budget)
                cpu_cells = "– | –"
                if not args.no_cpu:
                    cpu_target = cluster.target(gpus, "cpu")
                    cpu = cached_analysis(weak_scale(run, stage, gpus, 4), cpu_target, budget)
                    cpu_cells = f"{memory_cells(cpu)} | {cpu.compile_time_s:.0f}"
                kernels = gpu.kernels
                lines.append(
                    f"| {model} | {nodes} | {stage} | {memory_cells(gpu)} | "
                    f"{gpu.compile_time_s:.0f} | {cpu_cells} | {kernels.kernels:,} "
                    f"({kernels.gemm.count:,} GEMMs) |"
                )
                print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))
    print(f"\n{time.perf_counter() - started:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
