"""Train-step speed on this machine: tokens/s, MFU against the measured matmul peak, compile time.

    python bench/bench_step.py [--models mt5_tiny mt5_small] [--steps 3] [--rounds 2] [--no-torch]
    python bench/bench_step.py --models mt5_small mt5_base --batch 32 --input-length 1024 \
        --target-length 229 --dtype bfloat16 --steps 10        # on a GPU

Not a test: it prints a markdown table (and JSON with --out) for docs/benchmarks.md.

Each run (t5scale on one device, each ZeRO stage on all devices, the transformers baseline) is
a process of its own that compiles, takes one warm-up step and then --steps timed steps back to
back, each timed to block_until_ready, as a training run would; compile time is reported apart.
With --steps-per-execution k > 1, t5scale's runs take k steps per XLA execution
(TrainConfig.steps_per_execution), warm up with one execution and time ceil(--steps / k)
executions, each giving its time over k as the step time; one device is then also run at k = 1.
Runs go one at a time, in --rounds rounds whose order alternates (forwards, then backwards), so
that a machine whose speed drifts favours no run. A step is never timed right after another
run's step: on this 2-core VM a step that follows another program's step was up to 20% slower
than one that follows its own (docs/benchmarks.md, 2026-11-24), a condition no training run
meets. "speed vs 1 device" is the median over rounds of the 1-device t5scale run's median
step time over the run's, in the same round. MFU = model FLOPs per step (t5scale.analysis.flops)
/ (step time · peak · devices), the peak being this machine's measured fp32 matmul FLOP/s shared
by all emulated devices (they share the same cores), so 8 emulated devices are held to one peak.
The Hugging Face PyTorch MT5ForConditionalGeneration baseline runs on the same config, batch,
lengths and optimizer (AdamW, lr 1e-3, weight decay 0.01, no gradient clipping).

On a GPU the same script runs on the one device it has (ZeRO stages need several), measures the
matmul peak in the compute dtype (bf16: 8192³), and runs the transformers baseline on CUDA with
bf16 autocast and fp32 parameters, the same mixed precision t5scale uses with --dtype bfloat16.
Each run having the card to itself, JAX's memory pool and torch's never meet.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

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
from t5scale.train.step import batch_sharding, make_train_step, stack_batches  # noqa: E402

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


def prepare_t5scale(
    model_name: str, stage: int, devices: list, setup: Setup, steps_per_execution: int = 1
) -> Prepared:
    """With steps_per_execution k > 1, `step` is one execution of k steps (t5scale/train/step.py)."""
    model = dataclasses.replace(preset(model_name), dtype=setup.dtype, remat=setup.remat)
    data = DataConfig(input_length=setup.input_length, target_length=setup.target_length)
    # Plain AdamW without clipping, exactly as the transformers baseline runs it.
    tx = optim.make_optimizer(optim.OptimizerConfig(grad_clip_norm=None))
    mesh = make_mesh(ParallelConfig(zero_stage=stage, zero=len(devices)), devices)
    plan = plan_for(model, stage, mesh)
    shardings = state_shardings(plan, tx, abstract_state(model, tx))
    k = steps_per_execution
    batches = [
        jax.device_put(
            synthetic_batch(data, setup.batch, model.vocab_size, 0, i), batch_sharding(plan)
        )
        for i in range(2)
    ]
    framework = "t5scale (JAX)" + (f", {k} steps per execution" if k > 1 else "")
    row = {"model": model_name, "framework": framework, "stage": stage, "devices": len(devices),
           "steps_per_execution": k}  # fmt: skip
    # Whether it fits is judged on the one-step program: XLA's memory analysis of the k-step
    # loop under-counts its temporaries on several devices (mt5_small at stage 1 on 8 devices:
    # 0.79 against 1.81 GiB per device; it was killed for memory when run).
    started = time.perf_counter()
    one_step = make_train_step(model, plan, tx, shardings)
    compiled = one_step.lower(abstract_state(model, tx), batches[0]).compile()
    row["compile_s"] = time.perf_counter() - started
    peak = compiled_memory(compiled)["peak_estimate_bytes"]
    row["memory_per_device_gib"] = peak / 2**30
    if peak > memory_budget(devices):
        return Prepared(row | {"status": "does not fit"}, None)
    if k > 1:  # k batches, alternating as the one-step runs' do
        batches = [stack_batches([batches[i % 2] for i in range(k)], plan)] * 2
        started = time.perf_counter()
        k_steps = make_train_step(model, plan, tx, shardings, steps_per_execution=k)
        compiled = k_steps.lower(abstract_state(model, tx), batches[0]).compile()
        row["compile_s"] = time.perf_counter() - started  # the program that is timed
    held = {"state": create_state(model, tx, plan, seed=0), "i": 0}

    def step() -> None:
        held["state"], metrics = compiled(held["state"], batches[held["i"] % 2])
        jax.block_until_ready((held["state"], metrics))
        held["i"] += 1

    step()  # warm-up
    return Prepared(row | {"status": "ok"}, step)


def prepare_transformers(model_name: str, setup: Setup) -> Prepared:
    import contextlib

    import torch
    from transformers import MT5Config, MT5ForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    # XLA:CPU flushes denormals to zero (FTZ/DAZ); PyTorch keeps them by default, and on an
    # Intel CPU its matmuls ran 4-5x slower from the second step on (mt5_small: 90-100 s per
    # step against 19-20 s; docs/benchmarks.md, 2026-11-25). Same numerics on both sides.
    torch.set_flush_denormal(True)
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
    return Prepared(row, step)


def timed(step: Callable[[], None], steps: int = 1) -> float:
    """Seconds per step of one call of `step`, which takes `steps` steps."""
    started = time.perf_counter()
    step()
    return (time.perf_counter() - started) / steps


ROW_MARK = "bench-row: "  # the worker's one line of result on stdout


def worker(spec: dict) -> None:
    """In a process of its own: prepare one run, time its steps back to back, print its row."""
    if spec["framework"] == "peak":
        row = {"peak": matmul_peak(spec["dtype"]), "device_kind": jax.devices()[0].device_kind,
               "device_count": len(jax.devices())}  # fmt: skip
    else:
        setup = Setup(**spec["setup"])
        if spec["framework"] == "transformers":
            run = prepare_transformers(spec["model"], setup)
        else:
            devices = jax.devices()[: spec["devices"]]
            k = spec.get("steps_per_execution", 1)
            run = prepare_t5scale(spec["model"], spec["stage"], devices, setup, k)
        row = run.row
        if run.step is not None:
            k = row.get("steps_per_execution", 1)
            # An execution of k steps gives one time per step; --steps steps, rounded up to k.
            row["step_times_s"] = [timed(run.step, k) for _ in range(-(-setup.steps // k))]
    print(ROW_MARK + json.dumps(row), flush=True)


def in_own_process(spec: dict) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    rows = [line for line in done.stdout.splitlines() if line.startswith(ROW_MARK)]
    if done.returncode != 0 or not rows:
        sys.exit(f"bench: the run {spec} failed (exit code {done.returncode})")
    return json.loads(rows[-1][len(ROW_MARK) :])


def time_runs(specs: list[dict], rounds: int) -> list[dict]:
    """Each spec's row, its step times gathered over `rounds` rounds of alternating order; the
    first spec is the reference that "speed vs 1 device" compares with."""
    rows: list[dict | None] = [None] * len(specs)
    medians: list[list[float]] = [[] for _ in specs]
    for r in range(rounds):
        order = list(range(len(specs)))[:: 1 if r % 2 == 0 else -1]
        for i in order:
            if rows[i] is not None and rows[i]["status"] != "ok":
                continue  # compiled once: it does not fit
            row = in_own_process(specs[i])
            print(f"round {r + 1}/{rounds}: {json.dumps(row)}", file=sys.stderr, flush=True)
            if rows[i] is None:
                rows[i] = row
            elif "step_times_s" in row:
                rows[i]["step_times_s"] += row["step_times_s"]
            if "step_times_s" in row:
                medians[i].append(statistics.median(row["step_times_s"]))
    for row, per_round in zip(rows, medians, strict=True):
        if row["status"] == "ok":
            row["step_s"] = statistics.median(row["step_times_s"])
            row["round_medians_s"] = per_round
    for row, per_round in zip(rows[1:], medians[1:], strict=True):
        if row["status"] == "ok" and medians[0]:
            # > 1: faster than the reference in the same round
            row["speed_vs_1_device"] = statistics.median(
                ref / own for ref, own in zip(medians[0], per_round, strict=True)
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mt5_tiny", "mt5_small"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="k > 1: t5scale also runs k steps per XLA execution on one device, "
                             "and so on all devices (TrainConfig.steps_per_execution)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-length", type=int, default=512)
    parser.add_argument("--target-length", type=int, default=114)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--remat", choices=["none", "minimal", "full"], default="none")
    parser.add_argument("--torch-models", nargs="*", default=["mt5_small"],
                        help="models that also get the transformers baseline")  # fmt: skip
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-t5scale", action="store_true", help="only the baseline")
    parser.add_argument("--out", help="write the results as JSON here too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one run, in a process of its own
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.steps < 1 or args.rounds < 1 or args.steps_per_execution < 1:
        parser.error("--steps, --rounds and --steps-per-execution must be at least 1")
    setup = Setup(args.batch, args.input_length, args.target_length, args.dtype, args.remat,
                  args.steps)  # fmt: skip

    machine = in_own_process({"framework": "peak", "dtype": setup.dtype})
    peak, device_kind = machine["peak"], machine["device_kind"]
    print(f"measured {setup.dtype} matmul peak: {peak / 1e12:.3f} TFLOP/s ({device_kind})")
    rows = []
    for name in args.models:
        flops = training_flops_per_step(
            preset(name), setup.batch, setup.input_length, setup.target_length
        )
        t5scale_run = {"framework": "t5scale (JAX)", "model": name,
                       "setup": dataclasses.asdict(setup)}  # fmt: skip
        specs = []
        k = {"steps_per_execution": args.steps_per_execution}
        if not args.no_t5scale:
            # The reference ("speed vs 1 device"): one device at --steps-per-execution.
            specs.append(t5scale_run | {"stage": 0, "devices": 1} | k)
            if args.steps_per_execution > 1:
                specs.append(t5scale_run | {"stage": 0, "devices": 1})
            if machine["device_count"] > 1:
                specs += [t5scale_run | {"stage": st, "devices": machine["device_count"]} | k
                          for st in range(4)]  # fmt: skip
        if name in args.torch_models and not args.no_torch:
            specs.append(t5scale_run | {"framework": "transformers"})
        for run in time_runs(specs, args.rounds):
            run["model_flops_per_step"] = flops
            if run["status"] == "ok":
                run["tokens_per_s"] = setup.tokens_per_step / run["step_s"]
                # emulated CPU devices share one peak; a GPU run uses one device
                run["mfu"] = mfu(flops, run["step_s"], peak, 1)
            rows.append(run)

    print(f"\n{device_kind}: batch {setup.batch}, lengths {setup.input_length}/"
          f"{setup.target_length}, AdamW (no clipping), {setup.dtype}, remat {setup.remat}; "
          f"each run in its own process, {setup.steps} steps back to back after 1 warm-up, in "
          f"{args.rounds} rounds of alternating order; step s: the median of all its steps\n")  # fmt: skip
    print("| model | framework | devices | stage | compile s | step s | tokens/s | MFU "
          "| speed vs 1 device |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        ratio = f"{r['speed_vs_1_device']:.2f}×" if "speed_vs_1_device" in r else "-"
        if r["status"] != "ok":
            print(f"| {r['model']} | {r['framework']} | {r['devices']} | {r['stage']} | "
                  f"{compile_s} | {r['status']} ({r['memory_per_device_gib']:.1f} GiB/device) | | | |")  # fmt: skip
            continue
        print(f"| {r['model']} | {r['framework']} | {r['devices']} | {r['stage']} | {compile_s} | "
              f"{r['step_s']:.3g} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.0f}% | "
              f"{ratio} |")  # fmt: skip
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"matmul_peak_flops": peak, "setup": dataclasses.asdict(setup),
                       "device": device_kind, "rounds": args.rounds, "runs": rows}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
