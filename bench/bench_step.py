"""Train-step speed on this machine: tokens/s, MFU against the measured matmul peak, compile time.

    python bench/bench_step.py [--models mt5_tiny mt5_small] [--steps 3] [--no-torch] [--out F]

Not a test: it prints a markdown table (and JSON with --out) for docs/benchmarks.md. Step time
is the median of --steps timed steps after one warm-up step, each timed to block_until_ready;
compile time is reported apart. MFU = model FLOPs per step (t5scale.analysis.flops) / (step time ·
peak · devices), the peak being this machine's measured fp32 matmul FLOP/s shared by all
emulated devices (they share the same cores), so 8 emulated devices are held to one peak.
The Hugging Face PyTorch MT5ForConditionalGeneration baseline runs on the same config, batch,
lengths and optimizer (AdamW, lr 1e-3, weight decay 0.01, no gradient clipping), in the same
process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

import t5scale  # noqa: F401  (CPU collective-ordering flag, before JAX starts)

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402

from t5scale.analysis.flops import mfu, training_flops_per_step  # noqa: E402
from t5scale.analysis.memory import compiled_memory  # noqa: E402
from t5scale.data.synthetic import DataConfig, synthetic_batch  # noqa: E402
from t5scale.model.sizes import preset  # noqa: E402
from t5scale.parallel.mesh import ParallelConfig, make_mesh  # noqa: E402
from t5scale.train import optim  # noqa: E402
from t5scale.train.state import abstract_state, create_state, plan_for, state_shardings  # noqa: E402
from t5scale.train.step import batch_sharding, make_train_step  # noqa: E402

BATCH, INPUT_LENGTH, TARGET_LENGTH = 8, 512, 114
MEMORY_BUDGET = 20 * 2**30  # of this machine's 24 GiB, shared by every emulated device


def matmul_peak(n: int = 4096, repeats: int = 5) -> float:
    """FLOP/s of a large fp32 matmul on one device (median of `repeats`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def bench_t5scale(model_name: str, stage: int, devices: list, steps: int) -> dict:
    model = preset(model_name)
    data = DataConfig(input_length=INPUT_LENGTH, target_length=TARGET_LENGTH)
    # Plain AdamW without clipping, exactly as the transformers baseline runs it.
    tx = optim.make_optimizer(optim.OptimizerConfig(grad_clip_norm=None))
    mesh = make_mesh(ParallelConfig(zero_stage=stage, zero=len(devices)), devices)
    plan = plan_for(model, stage, mesh)
    shardings = state_shardings(plan, tx, abstract_state(model, tx))
    step = make_train_step(model, plan, tx, shardings)
    batches = [
        jax.device_put(synthetic_batch(data, BATCH, model.vocab_size, 0, i), batch_sharding(plan))
        for i in range(2)
    ]
    result = {"model": model_name, "stage": stage, "devices": len(devices)}
    started = time.perf_counter()
    compiled = step.lower(abstract_state(model, tx), batches[0]).compile()
    result["compile_s"] = time.perf_counter() - started
    peak = compiled_memory(compiled)["peak_estimate_bytes"]
    result["memory_per_device_gib"] = peak / 2**30
    if peak * len(devices) > MEMORY_BUDGET:
        return result | {"status": "does not fit in 24 GiB"}
    state = create_state(model, tx, plan, seed=0)
    state, metrics = compiled(state, batches[0])  # warm-up
    jax.block_until_ready((state, metrics))
    times = []
    for i in range(steps):
        started = time.perf_counter()
        state, metrics = compiled(state, batches[(i + 1) % 2])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - started)
    del state
    return result | {"status": "ok", "step_s": statistics.median(times), "step_times_s": times}


def bench_transformers(model_name: str, steps: int) -> dict:
    import torch
    from transformers import MT5Config, MT5ForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    m = preset(model_name)
    config = MT5Config(
        vocab_size=m.vocab_size, d_model=m.d_model, d_ff=m.d_ff, num_heads=m.num_heads,
        d_kv=m.d_kv, num_layers=m.num_encoder_layers, num_decoder_layers=m.num_decoder_layers,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
    )  # fmt: skip
    model = MT5ForConditionalGeneration(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    inputs = torch.randint(2, m.vocab_size, (BATCH, INPUT_LENGTH))
    labels = torch.randint(2, m.vocab_size, (BATCH, TARGET_LENGTH))

    def step() -> None:
        model(input_ids=inputs, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return {"model": model_name, "stage": "-", "devices": 1, "framework": "transformers (PyTorch)",
            "status": "ok", "step_s": statistics.median(times), "step_times_s": times}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mt5_tiny", "mt5_small"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()

    peak = matmul_peak()
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s ({jax.devices()[0].device_kind})")
    rows = []
    for name in args.models:
        flops = training_flops_per_step(preset(name), BATCH, INPUT_LENGTH, TARGET_LENGTH)
        runs = [bench_t5scale(name, 0, jax.devices()[:1], args.steps)]
        runs += [bench_t5scale(name, stage, jax.devices(), args.steps) for stage in range(4)]
        if name == "mt5_small" and not args.no_torch:
            runs.append(bench_transformers(name, args.steps))
        for run in runs:
            run.setdefault("framework", "t5scale (JAX)")
            run["model_flops_per_step"] = flops
            if run["status"] == "ok":
                run["tokens_per_s"] = BATCH * (INPUT_LENGTH + TARGET_LENGTH) / run["step_s"]
                run["mfu"] = mfu(flops, run["step_s"], peak, 1)  # emulated devices share one peak
            rows.append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)

    print(f"\nbatch {BATCH}, lengths {INPUT_LENGTH}/{TARGET_LENGTH}, AdamW (no clipping), fp32, remat none; "
          f"median of {args.steps} steps after 1 warm-up\n")  # fmt: skip
    print("| model | framework | devices | stage | compile s | step s | tokens/s | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        if r["status"] != "ok":
            print(f"| {r['model']} | {r['framework']} | {r['devices']} | {r['stage']} | "
                  f"{compile_s} | {r['status']} ({r['memory_per_device_gib']:.1f} GiB/device) | | |")  # fmt: skip
            continue
        print(f"| {r['model']} | {r['framework']} | {r['devices']} | {r['stage']} | {compile_s} | "
              f"{r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.0f}% |")  # fmt: skip
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"matmul_peak_flops": peak, "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
