"""The GPU check (issue 50): t5scale's kernels, steps and cluster model on one GPU, in one run.

    # on a GPU machine, from a copy of the source tree (docs/gpu_check.md: the wheels it carries)
    PYTHONPATH=.:/tmp/site python3 bench/gpu_check.py --out gpu_check
    python bench/gpu_check.py --dry-run --out /tmp/gpu_check   # CPU: mt5_tiny, the interpreter
    python bench/gpu_check.py --table gpu_check/results.jsonl  # the tables of a run, cut or not

The work list runs most valuable first, each item in a process of its own (one that crashes or
runs out of memory costs that item alone, and each has the device's whole memory and its own
allocator peak), within --budget-s seconds of wall time from the start, compiles included:

1. device: the GPU, driver and jax; the bf16 matmul peak (a chain of 20 8192³ products, median
   of 5) and the device-to-device copy bandwidth (bytes read + written);
2. kernels in bf16 (and, last of all, in fp32): the fused attention kernels
   (t5scale/model/attention_kernels.py) against the einsum path at mT5-Large's shapes (batch 32, 16 heads of 64; the encoder's 1024,
   the causal decoder's 229, the cross attention 229 × 1024), packed with padding: the output's
   and the gradients' (q, k, v, bias) max error relative to the largest value, the same
   measure and tolerance as tests/test_attention.py, each also against fp32 einsums at full
   precision; and milliseconds per forward + backward of each path;
3. steps: mixed precision, batch 32 of 1024/229, AdamW without clipping, synthetic data: the
   median of 10 timed steps after 2 warm-ups, tokens/s, MFU, XLA's and the allocator's peak,
   and the cluster model's prediction for the same program (predict_from_program, the GPU
   path of `t5scale simulate`) with its error. mt5_large with remat dots and full, fused and
   dot (dot only where XLA says it fits), mt5_small with remat dots, then mt5_large fused with
   the layers unrolled; then the kernels in fp32.

Results go to OUT/results.jsonl as they come (one JSON line each) and, at the end, to
OUT/gpu_check.md; the log of each item's process to OUT/log.txt, and each step's compiled
program to OUT/programs.zip (the cluster model's reading of it can be redone without a GPU).
--dry-run runs the same work list on the CPU with mt5_tiny at small lengths, the kernels under Pallas's interpreter and the
prediction from the same run compiled for an H100 without one (jax's CUDA plugin): it checks
the script, not a GPU (tests/test_gpu_check.py runs it).
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
import zipfile
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes one check runs at: the card's, or the dry run's."""

    batch: int
    input_length: int
    target_length: int
    heads: int  # the kernels' check: heads of d_kv 64
    models: tuple[str, str]  # (large, small)
    timed_steps: int = 10
    warmup_steps: int = 2
    matmul: tuple[int, int] = (8192, 20)  # size, products per sample
    remats: tuple[str, ...] = ("dots", "full")  # the large model's
    unrolled: bool = True  # the unrolled layers' step too


GPU = Shapes(32, 1024, 229, 16, ("mt5_large", "mt5_small"))
# The dry run checks the script: remat 'full' and the unrolled layers are the same code as the
# loop with 'dots' under other settings, and its two models are one (a run listed runs once).
DRY_RUN = Shapes(2, 96, 23, 2, ("mt5_tiny", "mt5_tiny"), 3, 1, (256, 2), ("dots",), False)


@dataclasses.dataclass(frozen=True)
class Item:
    """One entry of the work list: `estimate_s`, its wall time on one H100 (docs/gpu_check.md)."""

    name: str
    estimate_s: float
    kind: str  # device | kernels | step
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


def work_list(shapes: Shapes) -> list[Item]:
    """The items in the order they run: the answers worth most first."""
    large, small = shapes.models

    def step(role: str, remat: str, attention: str, estimate: float, unrolled=False) -> Item:
        model = large if role == "large" else small
        layers = "unrolled" if unrolled else "loop"
        options = dict(model=model, remat=remat, attention=attention, scan_layers=not unrolled)
        return Item(f"step {model} {remat} {attention} {layers}", estimate, "step", options)

    items = [
        # estimates: the H100's walls of 2026-11-28 (the H200's for the fp32 kernels; the
        # kernels' item since compiles its fused programs again to count their FLOPs)
        Item("device", 14, "device"),
        Item("kernels bfloat16", 95, "kernels", {"dtype": "bfloat16"}),
        step("large", "dots", "fused", 36),
        step("large", "dots", "dot", 35),  # compiled only: it does not fit an 80 GB H100
        step("large", "full", "fused", 36),
        step("large", "full", "dot", 53),
        step("small", "dots", "fused", 37),
        step("small", "dots", "dot", 49),
        step("large", "dots", "fused", 200, unrolled=True),  # cut at 182 s on the H100
        # last: 'auto' no longer runs the kernels in fp32, and their fp32 takes the longest
        Item("kernels float32", 109, "kernels", {"dtype": "float32"}),
    ]
    items = [
        item for item in items
        if item.options.get("remat", "dots") in shapes.remats
        and (shapes.unrolled or item.options.get("scan_layers", True))
    ]  # fmt: skip
    return list({item.name: item for item in items}.values())


# ---------------------------------------------------------------------------------------------
# Each item's process: imports JAX, measures, appends its JSON lines.


class Results:
    """OUT/results.jsonl, one line per result, written at once (a run cut short keeps them)."""

    def __init__(self, path: Path, item: str):
        self.path, self.item = path, item

    def write(self, **fields: Any) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"item": self.item, **fields}, default=float) + "\n")


def start_jax(dry_run: bool):
    if dry_run:
        from t5scale.xla_cpu import emulate_cpu_devices

        emulate_cpu_devices(1)
    import jax

    return jax


def timed(function, *arguments, repeats: int) -> float:
    """Median seconds of `function(*arguments)` to block_until_ready, after one warm-up."""
    import jax

    jax.block_until_ready(function(*arguments))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*arguments))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def device_item(results: Results, shapes: Shapes, dry_run: bool) -> None:
    jax = start_jax(dry_run)
    import jax.numpy as jnp

    device = jax.devices()[0]
    driver = _nvidia_smi("driver_version,name,memory.total")
    import flax
    import optax

    results.write(
        device=device.device_kind, platform=device.platform, driver=driver,
        jax=jax.__version__, flax=flax.__version__, optax=optax.__version__,
        python=sys.version.split()[0],
    )  # fmt: skip
    size, products = shapes.matmul
    matrix = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)

    @jax.jit
    def chain(product):
        for _ in range(products):  # a chain, so that none is optimised away
            product = product @ matrix
        return product

    seconds = timed(chain, matrix, repeats=5)
    results.write(bf16_matmul_flops=products * 2 * size**3 / seconds, matmul_size=size)
    length = (1024 if not dry_run else 16) * MIB  # bf16 elements: 2 GiB on the card
    array = jnp.ones((length,), jnp.bfloat16)
    seconds = timed(jax.jit(lambda x: x + 1), array, repeats=10)
    results.write(copy_bytes_per_s=2 * array.nbytes / seconds, copy_bytes=array.nbytes)


def _nvidia_smi(fields: str) -> str | None:
    try:
        query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


# (attention, causal, bias, query length, key length)
def attention_cases(shapes: Shapes) -> list[tuple[str, bool, bool, int, int]]:
    encoder, decoder = shapes.input_length, shapes.target_length
    return [
        ("encoder", False, True, encoder, encoder),
        ("decoder", True, True, decoder, decoder),
        ("cross", False, False, decoder, encoder),
    ]


# tests/test_attention.py's tolerances: the kernel against the einsum path in the same dtype
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def kernels_item(results: Results, shapes: Shapes, dry_run: bool, dtype: str) -> None:
    jax = start_jax(dry_run)
    import numpy as np

    rng = np.random.default_rng(0)
    for case in attention_cases(shapes):
        results.write(
            **attention_case(jax, rng, shapes, dtype, *case, repeats=2 if dry_run else 10)
        )


def attention_case(
    jax, rng, shapes: Shapes, dtype: str, what: str, causal: bool, with_bias: bool,
    q_len: int, k_len: int, repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """One attention at its lengths: the fused kernels' errors against the einsum path and
    against exact fp32 einsums, output and gradients, and both paths' forward + backward time."""
    import jax.numpy as jnp

    from t5scale.model.attention_kernels import flash_attention
    from t5scale.model.attention_reference import packed_segment_ids, reference_attention

    batch, heads = shapes.batch, shapes.heads
    q, k, v = (jnp.asarray(rng.normal(size=(batch, n, heads, 64)), dtype)
               for n in (q_len, k_len, k_len))  # fmt: skip
    bias = jnp.asarray(rng.normal(size=(heads, q_len, k_len)), jnp.float32) if with_bias else None
    q_segments = jnp.asarray(packed_segment_ids(rng, batch, q_len))
    k_segments = (
        q_segments if q_len == k_len else jnp.asarray(packed_segment_ids(rng, batch, k_len))
    )
    valid = (q_segments > 0)[:, :, None, None]  # padding queries' outputs are unused
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * valid
    wrt = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    interpret = jax.devices()[0].platform != "gpu"

    def fused(*arguments):
        return flash_attention(*arguments, interpret=interpret)

    # Everything the program reads is an argument: arrays it closes over would be constants,
    # which XLA folds at compile time (minutes for these sizes).
    arrays = (q, k, v, bias, q_segments, k_segments, weights, valid)

    def with_gradients(attend, precision=None):
        def loss(q, k, v, bias, q_segments, k_segments, weights, valid):
            out = attend(q, k, v, bias, q_segments, k_segments, causal)
            return jnp.sum(out.astype(jnp.float32) * weights), out * valid

        def run(*arrays):
            with jax.default_matmul_precision(precision) if precision else nullcontext():
                (_, out), grads = jax.value_and_grad(loss, wrt, has_aux=True)(*arrays)
            return (out, *grads)

        return jax.jit(run)

    paths = {"fused": with_gradients(fused), "dot": with_gradients(reference_attention)}
    got = {name: path(*arrays) for name, path in paths.items()}
    as32 = [None if x is None else x.astype(jnp.float32) for x in (q, k, v, bias)]
    exact = with_gradients(reference_attention, "highest")(*as32, *arrays[4:])
    names = ["out", "dq", "dk", "dv", "d_bias"][: len(exact)]
    errors = {
        "fused_vs_dot": _errors(names, got["fused"], got["dot"]),
        "fused_vs_exact": _errors(names, got["fused"], exact),
        "dot_vs_exact": _errors(names, got["dot"], exact),
    }
    # 'ok': within the interpreter tests' tolerance of the einsum path. Else 'nearer exact' or
    # 'as dot': no further from exact fp32 than the einsum path is (its bf16 probabilities or
    # TF32 matmuls on the card), output and every gradient; 'WRONG' otherwise.
    within = max(errors["fused_vs_dot"].values()) <= TOLERANCE[dtype]
    fused_exact, dot_exact = errors["fused_vs_exact"], errors["dot_vs_exact"]
    nearer = all(fused_exact[n] <= dot_exact[n] for n in names)
    as_dot = all(fused_exact[n] <= 2 * dot_exact[n] + 1e-6 for n in names)
    verdict = "ok" if within else "nearer exact" if nearer else "as dot" if as_dot else "WRONG"
    milliseconds = {name: 1e3 * timed(path, *arrays, repeats=repeats)
                    for name, path in paths.items()}  # fmt: skip
    from t5scale.analysis.peaks import datasheet_peak

    compiled_fused = with_gradients(partial(flash_attention, interpret=False))
    return dict(
        attention=what, dtype=dtype, causal=causal, bias=with_bias, q=q_len, k=k_len,
        batch=batch, heads=heads, errors=errors, tolerance=TOLERANCE[dtype],
        verdict=verdict,
        ms_fused=milliseconds["fused"], ms_dot=milliseconds["dot"],
        # counted for bf16 only: the rate a cluster file takes is bf16's, and a compile costs
        fused_flops=(fused_attention_flops(jax, compiled_fused, arrays)
                     if dtype == "bfloat16" else None),  # fmt: skip
        datasheet_flops=datasheet_peak(dtype),
    )  # fmt: skip


def fused_attention_flops(jax, function, arrays) -> float | None:
    """The fused kernels' FLOPs in `function`'s program as the kernel inventory counts them
    (what ClusterConfig.attention_efficiency is a rate of): the card's own program, or in a dry
    run the same function compiled for one H100 without one (None without jax's CUDA plugin)."""
    from jax.sharding import SingleDeviceSharding

    from t5scale.analysis.hlo_module import parse_module
    from t5scale.analysis.kernels import read_program

    if jax.devices()[0].platform == "gpu":
        return read_program(
            parse_module(function.lower(*arrays).compile().as_text())
        ).inventory.attention.flops
    target = _h100_target()
    if target is None:
        return None
    on_h100 = SingleDeviceSharding(target.devices[0])
    shapes = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_h100)
              for a in arrays]  # fmt: skip
    with target.compiling():
        compiled = function.lower(*shapes).compile(target.compiler_options)
    return read_program(parse_module(compiled.as_text())).inventory.attention.flops


def _errors(names: list[str], got, want) -> dict[str, float]:
    """Max |got − want| over max |want|, per output (tests/test_attention.py's measure)."""
    import numpy as np

    errors = {}
    for name, a, b in zip(names, got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        errors[name] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    return errors


TIMED_STEPS_S = 30.0  # at most this long timing one step (at least three timed steps)


def step_item(
    results: Results, shapes: Shapes, dry_run: bool, peak: float | None, **options: Any
) -> None:
    jax = start_jax(dry_run)
    from t5scale.analysis.flops import mfu, training_flops_per_step
    from t5scale.analysis.memory import allocator_peak, compiled_memory, device_memory_budget
    from t5scale.analysis.peaks import datasheet_peak
    from t5scale.data.synthetic import synthetic_batch
    from t5scale.train.setup import build_setup

    run = step_run(shapes, **options)
    setup = build_setup(run)
    step = setup.compile()
    memory = compiled_memory(step.compiled)
    budget = device_memory_budget(setup.mesh)
    xla_peak = memory.peak_estimate_bytes
    results.write(
        attention_ran=setup.run.model.attention,
        compile_s=step.compile_time_s,
        xla_peak_bytes=xla_peak,
        memory_limit_bytes=budget,
        fits=xla_peak <= budget,
    )
    if xla_peak > budget:
        return  # nothing runs: XLA's own estimate says it does not fit (docs/gpu_check.md)
    state = setup.create_state()
    batches = [
        jax.device_put(
            synthetic_batch(run.data, run.train.batch_size, run.model.vocab_size, 0, i),
            setup.batch_sharding(),
        )
        for i in range(3)
    ]
    seconds = []
    for i in range(shapes.warmup_steps + shapes.timed_steps):
        start = time.perf_counter()
        state, metrics = step.compiled(state, batches[i % len(batches)])
        jax.block_until_ready((state, metrics))
        seconds.append(time.perf_counter() - start)
        if sum(seconds) > TIMED_STEPS_S and i >= shapes.warmup_steps + 2:
            break  # a step far slower than expected: three timed steps say so, and save time
    timed_s = seconds[shapes.warmup_steps :]
    step_s = statistics.median(timed_s)
    tokens = run.train.batch_size * (run.data.input_length + run.data.target_length)
    flops = training_flops_per_step(run.model, run.train.batch_size, run.data.input_length,
                                    run.data.target_length)  # fmt: skip
    datasheet = datasheet_peak(run.model.dtype)
    results.write(
        step_s=step_s, steps_s=timed_s, warmup_s=seconds[: shapes.warmup_steps],
        tokens_per_s=tokens / step_s, loss=float(metrics.loss),
        mfu_measured_peak=mfu(flops, step_s, peak, 1) if peak else None,
        mfu_datasheet=mfu(flops, step_s, datasheet, 1) if datasheet else None,
        allocator_peak_bytes=allocator_peak(setup.mesh),
    )  # fmt: skip
    program = step if step.setup.target.is_gpu else _h100_program(run)
    if program is None:
        results.write(prediction=None, why="no GPU program: jax's CUDA plugin is not installed")
        return
    # The program itself, so that what the model made of it can be read again without a GPU.
    with zipfile.ZipFile(results.path.parent / "programs.zip", "a", zipfile.ZIP_DEFLATED) as z:
        z.writestr(results.item.replace(" ", "_") + ".hlo.txt", program.compiled.as_text())
    from t5scale.whatif.gpu_step import predict_program
    from t5scale.whatif.step_time import predict_from_program

    analysis, cluster = program.analysis, cluster_for(jax.devices()[0])
    predicted = predict_from_program(analysis, run.model, cluster)
    timed = predict_program(analysis.program, cluster, 1)
    results.write(
        predicted_step_s=predicted.step_s, predicted_compute_s=predicted.compute_s,
        predicted_by_class_s=timed.compute_by_class_s, predicted_launch_s=timed.launch_s,
        prediction_error=predicted.step_s / step_s - 1, cluster=cluster.name,
        kernels={kind: getattr(analysis.kernels, kind).count
                 for kind in ("gemm", "attention", "fusion", "copy")},
    )  # fmt: skip


def step_run(shapes: Shapes, model: str, remat: str, attention: str, scan_layers: bool):
    """The timed run: mixed precision, AdamW without clipping (as bench/bench_step.py)."""
    from t5scale.data.config import DataConfig
    from t5scale.model.sizes import preset
    from t5scale.train.config import RunConfig, TrainConfig
    from t5scale.train.optim import OptimizerConfig
    from t5scale.train.precision import PrecisionConfig

    model_config = dataclasses.replace(preset(model), dtype="bfloat16", remat=remat,
                                       attention=attention, scan_layers=scan_layers)  # fmt: skip
    return RunConfig(
        model=model_config,
        optimizer=OptimizerConfig(grad_clip_norm=None),
        train=TrainConfig(batch_size=shapes.batch),
        data=DataConfig(input_length=shapes.input_length, target_length=shapes.target_length),
        precision=PrecisionConfig(mode="mixed"),
    )


def _h100_target():
    """One H100 to compile for without one (XLA:GPU through jax's CUDA plugin), or None where
    the plugin is missing."""
    from t5scale import xla_gpu
    from t5scale.startup import cuda_plugin_installed
    from t5scale.target import Target

    if not cuda_plugin_installed():
        return None
    return Target.compile_only_gpus(xla_gpu.GpuTopology("h100_sxm", nodes=1, gpus_per_node=1))


def _h100_program(run):
    """The dry run's stand-in for the card's program: the same run compiled for one H100
    without one, or None where jax's CUDA plugin is missing."""
    from t5scale.train.setup import build_setup

    target = _h100_target()
    return None if target is None else build_setup(run, target).compile()


def cluster_for(device):
    """The cluster file of this GPU: gin/clusters/h200.gin on an H200, else h100.gin."""
    from t5scale.config import build_cluster_config, parse_gin

    kind = getattr(device, "device_kind", "")
    name = "h200" if "H200" in kind else "h100"
    parse_gin([str(ROOT / f"gin/clusters/{name}.gin")], [])
    return build_cluster_config(required=True)


ITEMS = {"device": device_item, "kernels": kernels_item, "step": step_item}


# Seconds a step's process takes besides compiling and stepping on the card: Python, JAX and
# CUDA starting, the state's init, the analysis of the program. 12 s on the H200 (2026-11-27:
# each mt5_large item's wall time less its compile and its steps).
STEP_OVERHEAD_S = 12.0
# The card's compile against the same program's compile-only one here: XLA:GPU autotunes its
# GEMMs on the card (11.7 s against 4.5 s, 22.1 s against 6.5 s: mt5_large, fused and dot).
COMPILE_ON_THE_CARD = 3.0


def estimates() -> None:
    """The work list's time on one H100, from programs compiled for it here (no GPU): each
    step's compile time on this machine and the cluster model's step time, as a table."""
    start_jax(False)
    from t5scale.xla_gpu import require_plugin

    require_plugin()  # one line naming the install where jax's CUDA plugin is missing
    print("| item | compile here | predicted step | estimate on an H100 |\n|---|---|---|---|")
    total = 0.0
    for item in work_list(GPU):
        if item.kind != "step":
            print(f"| {item.name} | – | – | {item.estimate_s:.0f} s (the list's figure) |")
            total += item.estimate_s
            continue
        run = step_run(GPU, **item.options)
        started = time.perf_counter()
        analysis = _h100_program(run).analysis
        compile_s = time.perf_counter() - started
        predicted = predict_h100(analysis, run)
        steps = GPU.warmup_steps + GPU.timed_steps
        estimate = STEP_OVERHEAD_S + COMPILE_ON_THE_CARD * compile_s + steps * predicted
        total += estimate
        print(f"| {item.name} | {compile_s:.0f} s | {predicted:.3f} s | {estimate:.0f} s |",
              flush=True)  # fmt: skip
    print(f"| all | | | {total:.0f} s |")


def predict_h100(analysis, run) -> float:
    from t5scale.whatif.step_time import predict_from_program

    return predict_from_program(analysis, run.model, cluster_for(None)).step_s


# ---------------------------------------------------------------------------------------------
# The parent: runs the work list within the budget, then writes the tables.


def run_all(out: Path, shapes: Shapes, dry_run: bool, budget_s: float, only: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    results_path, log_path = out / "results.jsonl", out / "log.txt"
    results_path.write_text("")
    log_path.write_text("")
    (out / "programs.zip").unlink(missing_ok=True)
    items = [item for item in work_list(shapes) if not only or item.name in only]
    started = time.perf_counter()
    for index, item in enumerate(items):
        elapsed = time.perf_counter() - started
        left = budget_s - elapsed
        estimate_left = sum(i.estimate_s for i in items[index:])
        print(f"[{elapsed:5.0f} s] {index + 1}/{len(items)} {item.name} "
              f"(H100 estimate {item.estimate_s:.0f} s; {estimate_left:.0f} s of the list left, "
              f"{left:.0f} s of the budget)", flush=True)  # fmt: skip
        if left < min(item.estimate_s / 2, 20):
            Results(results_path, item.name).write(status="skipped", why=f"{left:.0f} s left")
            continue
        peak = _measured_peak(results_path)
        command = [sys.executable, __file__, "--item", item.name, "--out", str(out)]
        command += ["--dry-run"] * dry_run + ([f"--peak={peak}"] if peak else [])
        status, why = _run_item(command, log_path, max(left, 10))
        Results(results_path, item.name).write(
            status=status, why=why, wall_s=time.perf_counter() - started - elapsed
        )
        for line in _lines_of(results_path, item.name):
            if "verdict" in line or "step_s" in line or "fits" in line:
                print("        " + _summary(line), flush=True)
    (out / "gpu_check.md").write_text(tables(results_path))
    print(f"[{time.perf_counter() - started:5.0f} s] done: {out / 'gpu_check.md'}", flush=True)
    print((out / "gpu_check.md").read_text(), flush=True)
    statuses = [line for line in _lines(results_path) if "status" in line]
    return 0 if all(line["status"] == "done" for line in statuses) else 1


def _run_item(command: list[str], log_path: Path, timeout_s: float) -> tuple[str, str | None]:
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))  # fmt: skip
    # JAX's allocator takes 75% of a GPU by default; a step that fits the card should run.
    environment.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        try:
            process = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                     env=environment, timeout=timeout_s)  # fmt: skip
        except subprocess.TimeoutExpired:
            return "cut", f"the budget ran out after {timeout_s:.0f} s"
    if process.returncode == 0:
        return "done", None
    last = [line for line in log_path.read_text().splitlines() if line.strip()][-1:]
    return "failed", f"exit {process.returncode}: {last[0][:300] if last else ''}"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _lines_of(path: Path, item: str) -> list[dict[str, Any]]:
    return [line for line in _lines(path) if line["item"] == item]


def _measured_peak(path: Path) -> float | None:
    return next((line["bf16_matmul_flops"] for line in _lines(path)
                 if "bf16_matmul_flops" in line), None)  # fmt: skip


def _summary(line: dict[str, Any]) -> str:
    if "verdict" in line:
        worst = max(line["errors"]["fused_vs_dot"].values())
        return (f"{line['attention']}: {line['verdict']} (fused vs dot {worst:.1e}); "
                f"{line['ms_fused']:.2f} ms fused, {line['ms_dot']:.2f} ms dot")  # fmt: skip
    if "step_s" in line:
        return f"{line['step_s']:.4f} s per step, {line['tokens_per_s']:,.0f} tokens/s"
    return f"XLA peak {line['xla_peak_bytes'] / 2**30:.1f} GiB, fits: {line['fits']}"


# ---------------------------------------------------------------------------------------------
# The tables (gpu_check.md), from results.jsonl.


def tables(path: Path) -> str:
    lines = _lines(path)
    merged: dict[str, dict[str, Any]] = {}
    for line in lines:
        if "attention" not in line:
            merged.setdefault(line["item"], {}).update(line)
    device = merged.get("device", {})
    text = ["# GPU check", ""]
    text.append(
        f"Device: {device.get('device', '?')} (driver, name, memory: {device.get('driver')}); "
        f"jax {device.get('jax')}, flax {device.get('flax')}, optax {device.get('optax')}, "
        f"Python {device.get('python')}."
    )
    if "bf16_matmul_flops" in device:
        text.append(
            f"Measured: bf16 matmul chain ({device['matmul_size']}³, median of 5) "
            f"{device['bf16_matmul_flops'] / 1e12:,.0f} TFLOP/s; device-to-device copy "
            f"{device.get('copy_bytes_per_s', 0) / 1e12:,.2f} TB/s (read + written, median of 10)."
        )
    if device.get("platform") == "cpu":
        text.append(
            "A dry run on the CPU (mt5_tiny, small lengths, Pallas's interpreter): it checks the "
            "script, not a GPU. Its predictions are one H100's and do not compare with its times."
        )
    text += ["", "## Kernels: fused against the einsum path ('dot')", "",
             "| attention | dtype | q × k | out | dq | dk | dv | d_bias | vs exact (fused / dot, "
             "worst) | verdict | fwd+bwd fused | fwd+bwd dot | fused TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for line in lines:
        if "verdict" not in line:
            continue
        errors = line["errors"]["fused_vs_dot"]
        cells = [f"{errors[n]:.1e}" if n in errors else "–"
                 for n in ("out", "dq", "dk", "dv", "d_bias")]  # fmt: skip
        exact = (max(line["errors"]["fused_vs_exact"].values()),
                 max(line["errors"]["dot_vs_exact"].values()))  # fmt: skip
        text.append(
            f"| {line['attention']} | {line['dtype']} | {line['q']} × {line['k']} | "
            + " | ".join(cells)
            + f" | {exact[0]:.1e} / {exact[1]:.1e} | {line['verdict']} | "
            f"{line['ms_fused']:.2f} ms | {line['ms_dot']:.2f} ms | "
            f"{_tflops(line.get('fused_flops'), line['ms_fused'])} |"
        )
    text += _attention_rate(lines)
    text += ["", "## Steps, and the cluster model's prediction for the same program", "",
             "| model | remat | attention | layers | compile | step (median) | tokens/s | "
             "MFU (measured peak) | MFU (datasheet) | XLA peak | allocator peak | predicted "
             "| error | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for item in work_list(GPU) + work_list(DRY_RUN):
        if item.kind == "step" and item.name in merged:
            text.append(_step_row(item, merged[item.name]))
    text += ["", "The prediction by kernel class (seconds per step; launches are in each class):",
             "", "| step | gemm | attention | fusion | copy | other | of which launches |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for item in work_list(GPU) + work_list(DRY_RUN):
        classes = merged.get(item.name, {}).get("predicted_by_class_s")
        if item.kind == "step" and classes:
            cells = " | ".join(f"{classes.get(kind, 0):.4f}"
                               for kind in ("gemm", "attention", "fusion", "copy", "other"))  # fmt: skip
            launches = merged[item.name]["predicted_launch_s"]
            text.append(f"| {item.name.removeprefix('step ')} | {cells} | {launches:.4f} |")
    for name, row in merged.items():
        if row.get("status") not in (None, "done"):
            text.append(f"\n{name}: {row['status']} — {row.get('why')}")
    return "\n".join(text) + "\n"


def _tflops(flops: float | None, milliseconds: float) -> str:
    return "–" if not flops else f"{flops / milliseconds / 1e9:,.1f}"


def _attention_rate(lines: list[dict[str, Any]]) -> list[str]:
    """The bf16 fused kernels' FLOP-weighted rate over the three attentions, and its share of
    the datasheet peak: a cluster file's `attention_efficiency` (gin/clusters/h100.gin)."""
    cases = [line for line in lines
             if line.get("dtype") == "bfloat16" and line.get("fused_flops")]  # fmt: skip
    if not cases:
        return []
    flops = sum(line["fused_flops"] for line in cases)
    rate = flops / (1e-3 * sum(line["ms_fused"] for line in cases))
    text = (f"\nThe bf16 fused kernels, FLOP-weighted (the kernel inventory's count, "
            f"{flops / 1e9:,.1f} GFLOP): {rate / 1e12:,.1f} TFLOP/s")  # fmt: skip
    datasheet = cases[0].get("datasheet_flops")
    if datasheet:
        text += f", {rate / datasheet:.3f} of the datasheet peak (`attention_efficiency`)"
    return [text + "."]


def _step_row(item: Item, row: dict[str, Any]) -> str:
    def gib(value):
        return "–" if value is None else f"{value / 2**30:.1f} GiB"

    def percent(value):
        return "–" if value is None else f"{100 * value:.1f}%"

    options = item.options
    layers = "loop" if options["scan_layers"] else "unrolled"
    step = row.get("step_s")
    status = row.get("status", "?")
    if row.get("fits") is False:
        status = f"does not fit ({gib(row['memory_limit_bytes'])} usable)"
    compile_s = row.get("compile_s")
    return (
        f"| {options['model']} | {options['remat']} | "
        f"{row.get('attention_ran', options['attention'])} | {layers} | "
        + ("–" if compile_s is None else f"{compile_s:.0f} s")
        + " | "
        + ("– | –" if step is None else f"{step:.4f} s | {row['tokens_per_s']:,.0f}")
        + f" | {percent(row.get('mfu_measured_peak'))} | "
        f"{percent(row.get('mfu_datasheet'))} | {gib(row.get('xla_peak_bytes'))} | "
        f"{gib(row.get('allocator_peak_bytes'))} | "
        + ("–" if "predicted_step_s" not in row else f"{row['predicted_step_s']:.4f} s")
        + f" | {percent(row.get('prediction_error'))} | {status} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check"))
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the CPU: mt5_tiny, small lengths, Pallas's interpreter",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=330.0,
        help="wall seconds for the whole list (items past it are skipped)",
    )
    parser.add_argument("--only", nargs="*", default=[], help="items by name (default: all)")
    parser.add_argument("--table", type=Path, help="print the tables of a results.jsonl")
    parser.add_argument(
        "--estimate",
        action="store_true",
        help="the list's time on one H100, from programs compiled for it here",
    )
    parser.add_argument("--item", help=argparse.SUPPRESS)  # one item's process
    parser.add_argument("--peak", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table:
        print(tables(args.table), end="")
        return
    if args.estimate:
        estimates()
        return
    shapes = DRY_RUN if args.dry_run else GPU
    names = [item.name for item in work_list(shapes)]
    if unknown := [name for name in [*args.only, *filter(None, [args.item])] if name not in names]:
        sys.exit(
            f"gpu_check: no item {', '.join(map(repr, unknown))}; the list: {', '.join(names)}"
        )
    if args.item:
        item = next(i for i in work_list(shapes) if i.name == args.item)
        results = Results(args.out / "results.jsonl", item.name)
        extra = {"peak": args.peak} if item.kind == "step" else {}
        ITEMS[item.kind](results, shapes, args.dry_run, **extra, **item.options)
        return
    sys.exit(run_all(args.out, shapes, args.dry_run, args.budget_s, args.only))


if __name__ == "__main__":
    main()
