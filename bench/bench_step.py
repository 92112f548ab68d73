"""Train-step speed on this machine: tokens/s, MFU against the measured matmul peak, compile time.

    python bench/bench_step.py [--models mt5_tiny mt5_small] [--steps 3] [--no-torch] [--out F]
    python bench/bench_step.py --models mt5_small mt5_base --batch 32 --input-length 1024 \
        --target-length 229 --dtype bfloat16 --steps 10        # on a GPU

Not a test: it prints a markdown table (and JSON with --out) for docs/benchmarks.md. Step time
is the median of --steps timed steps after one warm-up step, each timed to block_until_ready;
compile time is reported apart. Every run's steps alternate one by one with steps of the
1-device t5scale run (the reference), so that a comparison is made in the same moments of a
machine whose speed drifts; "speed vs 1 device, paired" is the median over those pairs of the
reference's step time over the run's. MFU = model FLOPs per step (t5scale.analysis.flops) / (step time ·
peak · devices), the peak being this machine's measured fp32 matmul FLOP/s shared by all
emulated devices (they share the same cores), so 8 emulated devices are held to one peak.
The Hugging Face PyTorch MT5ForConditionalGeneration baseline runs on the same config, batch,
lengths and optimizer (AdamW, lr 1e-3, weight decay 0.01, no gradient clipping), in the same
process, interleaved with the reference like the rest.

On a GPU the same script runs on the one device it has (ZeRO stages need several), measures the
matmul peak in the compute dtype (bf16: 8192³), and runs the transformers baseline on CUDA with
bf16 autocast and fp32 parameters, the same mixed precision t5scale uses with --dtype bfloat16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import jax

import t5scale  # noqa: F401  (CPU collective-ordering flag, before JAX starts)

jax.config.update("jax_num_cpu_devices", 8)


from t5scale.analysis.flops import mfu, training_flops_per_step  # noqa: E402
from t5scale.analysis.memory import compiled_memory  # noqa: E402
from t5scale.data.synthetic import DataConfig, synthetic_batch  # noqa: E402
from t5scale.model.sizes import preset  # noqa: E402
from t5scale.parallel.mesh import ParallelConfig, make_mesh  # noqa: E402
from t5scale.study.peak import matmul_peak  # noqa: E402
from t5scale.train import optim  # noqa: E402
from t5scale.train.state import abstract_state, create_state, plan_for, state_shardings  # noqa: E402
from t5scale.train.step import batch_sharding, make_train_step  # noqa: E402

CPU_MEMORY_BUDGET = 20 * 2**30  # of this machine's 24 GiB, shared by every emulated device


@dataclasses.dataclass(frozen=True)
class Setup:
    batch: int = 8
    input_length: int = 512
    target_length: int = 114
    dtype: str = "float32"
    remat: str = "none"
    steps: int = 3

    @property
    def tokens_per_step(self) -> int:
        return self.batch * (self.input_length + self.target_length)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def memory_budget(devices: list) -> int:
    if on_gpu():
        return int(devices[0].memory_stats()["bytes_limit"])
    return CPU_MEMORY_BUDGET // len(devices)


@dataclasses.dataclass
class Prepared:
    """A run ready to time: compiled (or built), its state made, one warm-up step taken."""

    row: dict
    step: Callable[[], None] | None  # one blocking training step; None: it does not fit
    release: Callable[[], None] = lambda: None


def prepare_t5scale(model_name: str, stage: int, devices: list, setup: Setup) -> Prepared:
    model = dataclasses.replace(preset(model_name), dtype=setup.dtype, remat=setup.remat)
    data = DataConfig(input_length=setup.input_length, target_length=setup.target_length)
    # Plain AdamW without clipping, exactly as the transformers baseline runs it.
    tx = optim.make_optimizer(optim.OptimizerConfig(grad_clip_norm=None))
    mesh = make_mesh(ParallelConfig(zero_stage=stage, zero=len(devices)), devices)
    plan = plan_for(model, stage, mesh)
    shardings = state_shardings(plan, tx, abstract_state(model, tx))
    train_step = make_train_step(model, plan, tx, shardings)
    batches = [
        jax.device_put(
            synthetic_batch(data, setup.batch, model.vocab_size, 0, i), batch_sharding(plan)
        )
        for i in range(2)
    ]
    row = {"model": model_name, "framework": "t5scale (JAX)", "stage": stage,
           "devices": len(devices)}  # fmt: skip
    started = time.perf_counter()
    compiled = train_step.lower(abstract_state(model, tx), batches[0]).compile()
    row["compile_s"] = time.perf_counter() - started
    peak = compiled_memory(compiled)["peak_estimate_bytes"]
    row["memory_per_device_gib"] = peak / 2**30
    if peak > memory_budget(devices):
        return Prepared(row | {"status": "does not fit"}, None)
    held = {"state": create_state(model, tx, plan, seed=0), "i": 0}

    def step() -> None:
        held["state"], metrics = compiled(held["state"], batches[held["i"] % 2])
        jax.block_until_ready((held["state"], metrics))
        held["i"] += 1

    step()  # warm-up
    return Prepared(row | {"status": "ok"}, step, held.clear)


def prepare_transformers(model_name: str, setup: Setup) -> Prepared:
    import contextlib

    import torch
    from transformers import MT5Config, MT5ForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    device = "cuda" if on_gpu() else "cpu"
    autocast = (
        torch.autocast(device, dtype=torch.bfloat16)
        if setup.dtype == "bfloat16"
        else contextlib.nullcontext()
    )
    m = preset(model_name)
    config = MT5Config(
        vocab_size=m.vocab_size, d_model=m.d_model, d_ff=m.d_ff, num_heads=m.num_heads,
        d_kv=m.d_kv, num_layers=m.num_encoder_layers, num_decoder_layers=m.num_decoder_layers,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
    )  # fmt: skip
    held = {"model": MT5ForConditionalGeneration(config).to(device).train()}
    # fused: one kernel for the whole update on CUDA (the fastest torch AdamW there).
    held["optimizer"] = torch.optim.AdamW(
        held["model"].parameters(), lr=1e-3, weight_decay=0.01, fused=device == "cuda"
    )
    inputs = torch.randint(2, m.vocab_size, (setup.batch, setup.input_length), device=device)
    labels = torch.randint(2, m.vocab_size, (setup.batch, setup.target_length), device=device)

    def step() -> None:
        with autocast:
            loss = held["model"](input_ids=inputs, labels=labels).loss
        loss.backward()
        held["optimizer"].step()
        held["optimizer"].zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up
    row = {"model": model_name, "stage": "-", "devices": 1,
           "framework": "transformers (PyTorch)", "status": "ok"}  # fmt: skip
    return Prepared(row, step, held.clear)


def timed(step: Callable[[], None]) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def time_runs(reference: Prepared | None, others: list[Callable[[], Prepared]], steps: int):
    """Time each run's steps interleaved one by one with the reference's, so that both see the
    same machine: on a shared 2-core VM the speed drifts by ±15% over minutes. Only the
    reference and one other run are alive at a time (memory). Returns the finished rows."""
    rows, reference_times = [], []
    for prepare in others:
        run = prepare()
        if run.step is not None:
            pairs = [
                (timed(reference.step) if reference else None, timed(run.step))
                for _ in range(steps)
            ]
            run.row["step_times_s"] = [t for _, t in pairs]
            if reference:
                reference_times += [r for r, _ in pairs]
                # > 1: faster than the reference in the same moments
                run.row["speed_vs_1_device"] = statistics.median(r / t for r, t in pairs)
        run.release()
        rows.append(run.row)
    if reference is not None:
        if not reference_times:  # nothing else to time: the reference alone
            reference_times = [timed(reference.step) for _ in range(steps)]
        reference.row["step_times_s"] = reference_times
        reference.release()
        rows.insert(0, reference.row)
    for row in rows:
        if row["status"] == "ok":
            row["step_s"] = statistics.median(row["step_times_s"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mt5_tiny", "mt5_small"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-length", type=int, default=512)
    parser.add_argument("--target-length", type=int, default=114)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--remat", choices=["none", "minimal", "full"], default="none")
    parser.add_argument("--torch-models", nargs="*", default=["mt5_small"],
                        help="models that also get the transformers baseline")  # fmt: skip
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-t5scale", action="store_true",
                        help="only the baseline (on a GPU, JAX's memory pool would starve torch "
                             "in the same process: run the two apart)")  # fmt: skip
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()
    setup = Setup(args.batch, args.input_length, args.target_length, args.dtype, args.remat,
                  args.steps)  # fmt: skip

    peak = matmul_peak(setup.dtype)
    device = jax.devices()[0]
    print(f"measured {setup.dtype} matmul peak: {peak / 1e12:.3f} TFLOP/s ({device.device_kind})")
    rows = []
    for name in args.models:
        flops = training_flops_per_step(
            preset(name), setup.batch, setup.input_length, setup.target_length
        )
        reference = None if args.no_t5scale else prepare_t5scale(name, 0, jax.devices()[:1], setup)
        others = []
        if not args.no_t5scale and len(jax.devices()) > 1:
            others += [partial(prepare_t5scale, name, st, jax.devices(), setup) for st in range(4)]
        if name in args.torch_models and not args.no_torch:
            others.append(partial(prepare_transformers, name, setup))
        for run in time_runs(reference, others, setup.steps):
            run["model_flops_per_step"] = flops
            if run["status"] == "ok":
                run["tokens_per_s"] = setup.tokens_per_step / run["step_s"]
                # emulated CPU devices share one peak; a GPU run uses one device
                run["mfu"] = mfu(flops, run["step_s"], peak, 1)
            rows.append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)

    print(f"\n{device.device_kind}: batch {setup.batch}, lengths {setup.input_length}/"
          f"{setup.target_length}, AdamW (no clipping), {setup.dtype}, remat {setup.remat}; "
          f"median of {setup.steps} steps after 1 warm-up, each interleaved with a step of the "
          f"1-device t5scale run (its row: the median of all of those)\n")  # fmt: skip
    print("| model | framework | devices | stage | compile s | step s | tokens/s | MFU "
          "| speed vs 1 device, paired |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        paired = f"{r['speed_vs_1_device']:.2f}×" if "speed_vs_1_device" in r else "-"
        if r["status"] != "ok":
            print(f"| {r['model']} | {r['framework']} | {r['devices']} | {r['stage']} | "
                  f"{compile_s} | {r['status']} ({r['memory_per_device_gib']:.1f} GiB/device) | | | |")  # fmt: skip
            continue
        print(f"| {r['model']} | {r['framework']} | {r['devices']} | {r['stage']} | {compile_s} | "
              f"{r['step_s']:.3g} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.0f}% | "
              f"{paired} |")  # fmt: skip
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"matmul_peak_flops": peak, "setup": dataclasses.asdict(setup),
                       "device": device.device_kind, "runs": rows}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
