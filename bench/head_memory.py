"""XLA's per-device memory of the compiled train step, with the output layer tiled or whole.

    python bench/head_memory.py [--models mt5_small mt5_base mt5_large] [--remats dots full]
        [--chunks 0 auto] [--batch 32] [--out docs/head_memory.json]

Compile only (nothing is allocated or run): one device, stage 0, batch 32 at the mT5
pretraining lengths 1024/229, bf16 compute with mixed precision (fp32 master and AdamW state),
the configuration of `t5scale plan --gin.DEVICES=1 --gin.PlanConfig.micro_batch_size=32
--gin.ModelConfig.dtype="'bfloat16'"`. `--chunks 0` is the untiled head (the whole
[tokens, vocab] logits, as before t5scale/model/head.py tiled it); `auto` the default chunks.
The figures are those of this machine's XLA (the CPU compiler): a GPU's compiler fuses and
schedules differently, so its temporaries differ; the shapes that dominate do not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax

from t5scale.model.sizes import ModelConfig
from t5scale.train.config import RunConfig
from t5scale.train.setup import build_setup
from t5scale.whatif.weak_scaling import weak_scale

GB = 1e9


def compiled_memory(model: str, remat: str, chunk: int | None, batch: int) -> dict:
    run = RunConfig(model=ModelConfig(name=model, dtype="bfloat16", remat=remat,
                                      loss_chunk_tokens=chunk))  # fmt: skip
    run = weak_scale(run, 0, 1, batch)
    step = build_setup(run, jax.devices()[:1]).compile()
    memory = step.analysis.memory_per_device
    return {
        "model": model, "remat": remat, "loss_chunk_tokens": chunk, "batch": batch,
        "lengths": [run.data.input_length, run.data.target_length],
        "remat_chosen": step.setup.run.model.remat,
        "peak_bytes": memory.peak_estimate_bytes, "temp_bytes": memory.temp_bytes,
        "argument_bytes": memory.argument_bytes, "compile_time_s": step.compile_time_s,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| model | remat | head | peak GB | temporaries GB | arguments GB |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        head = "whole logits" if r["loss_chunk_tokens"] == 0 else "tiled"
        remat = r["remat"] if r["remat"] != "auto" else f"auto → {r['remat_chosen']}"
        lines.append(
            f"| {r['model']} | {remat} | {head} | {r['peak_bytes'] / GB:.1f} | "
            f"{r['temp_bytes'] / GB:.1f} | {r['argument_bytes'] / GB:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mt5_small", "mt5_base", "mt5_large"])
    parser.add_argument("--remats", nargs="+", default=["dots", "full"])
    parser.add_argument("--chunks", nargs="+", default=["0", "auto"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for model in args.models:
        for remat in args.remats:
            for chunk in args.chunks:
                size = None if chunk == "auto" else int(chunk)
                rows.append(compiled_memory(model, remat, size, args.batch))
                print(
                    f"{model} remat {remat} chunk {chunk}: {rows[-1]['peak_bytes'] / GB:.1f} GB",
                    file=sys.stderr,
                    flush=True,
                )
    print(table(rows))
    if args.out:
        machine = {"backend": jax.default_backend(), "jax": jax.__version__,
                   "cpu_count": os.cpu_count()}  # fmt: skip
        args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
