"""The GPU check's device and step items (bench/gpu_check.py), each run in a process of its
own: imports JAX, measures, appends its JSON lines to OUT/results.jsonl."""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

from gpu_check_list import Results, Shapes
from gpu_check_profile import profile_steps

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


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
    _fp8_matmul(results, matrix, products)
    length = (1024 if not dry_run else 16) * MIB  # bf16 elements: 2 GiB on the card
    array = jnp.ones((length,), jnp.bfloat16)
    seconds = timed(jax.jit(lambda x: x + 1), array, repeats=10)
    results.write(copy_bytes_per_s=2 * array.nbytes / seconds, copy_bytes=array.nbytes)


def _fp8_matmul(results: Results, matrix, products: int) -> None:
    """The bf16 chain again through flax's FP8 dot (e4m3 operands, delayed scaling): on a
    Hopper card one FP8 cuBLASLt GEMM per product, counted in the compiled program. What it
    reaches of the FP8 peak is the cluster model's `gemm_efficiency_float8` (issue 62), assumed
    equal to the bf16 GEMMs' until this measures it."""
    import jax
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    scale, history = jnp.ones((1,), jnp.float32), jnp.zeros((16,), jnp.float32)
    meta = dict(lhs_scale=scale, rhs_scale=scale, grad_scale=scale, lhs_amax_history=history,
                rhs_amax_history=history, grad_amax_history=history)  # fmt: skip

    @jax.jit
    def chain(product):
        for _ in range(products):
            product = fp8_ops.fp8_scaled_dot_general(
                product, matrix, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16,
                quantize_compute_type=jnp.bfloat16, **meta,
            )  # fmt: skip
        return product

    compiled = chain.lower(matrix).compile()
    fp8_gemms = compiled.as_text().count('custom_call_target="__cublas$lt$matmul$f8"')
    seconds = timed(compiled, matrix, repeats=5)
    size = matrix.shape[0]
    results.write(fp8_matmul_flops=products * 2 * size**3 / seconds, fp8_gemms=fp8_gemms,
                  fp8_products=products)  # fmt: skip


def _nvidia_smi(fields: str) -> str | None:
    try:
        query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


TIMED_STEPS_S = 30.0  # at most this long timing one step (at least three timed steps)


def step_item(
    results: Results, shapes: Shapes, dry_run: bool, peak: float | None, **options: Any
) -> None:
    jax = start_jax(dry_run)
    from t5scale.train.setup import build_setup

    run = step_run(shapes, **options)
    setup = build_setup(run)
    step = setup.compile()
    if not _write_memory(results, setup, step):
        return  # nothing runs: XLA's own estimate says it does not fit (docs/gpu_check.md)
    seconds, losses, state, batches, create_state_s = _time_steps(jax, setup, step, run, shapes)
    results.write(create_state_s=create_state_s)
    step_s = _write_times(results, setup, run, shapes, peak, seconds, losses)
    state = _write_back_to_back(results, jax, step, state, batches, shapes, step_s)
    program = step if step.setup.target.is_gpu else h100_program(run)
    if program is None:
        results.write(prediction=None, why="no GPU program: jax's CUDA plugin is not installed")
    else:
        _write_prediction(results, jax.devices()[0], program, run, step_s)
    # Last: the profiler is the part most likely to fail, and what it saves is read elsewhere.
    profile_steps(results, step, state, batches, step_s)


def training_loop_item(
    results: Results, shapes: Shapes, dry_run: bool, peak: float | None, **options: Any
) -> None:
    """t5scale's own training loop (t5scale.train.loop.train) on the step item's run: its steps'
    times as metrics.jsonl records them, the host's work between steps (the next batch, the
    metrics read back) included where the loop does not hide it behind the device's."""
    start_jax(dry_run)
    from t5scale.train.loop import train
    from t5scale.train.setup import build_setup

    run = step_run(shapes, **options)
    steps = shapes.warmup_steps + shapes.timed_steps
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, steps=steps))
    records = train(run)
    seconds, losses = [r.step_time_s for r in records], [r.loss for r in records]
    setup = build_setup(run)
    results.write(attention_ran=setup.run.model.attention)
    _write_times(results, setup, run, shapes, peak, seconds, losses)


def _write_memory(results: Results, setup, step) -> bool:
    """XLA's peak against the memory the device has, written; whether the step fits."""
    from t5scale.analysis.memory import compiled_memory, device_memory_budget

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
    return xla_peak <= budget


def _time_steps(
    jax, setup, step, run, shapes: Shapes
) -> tuple[list[float], list[float], Any, list, float]:
    """Seconds and loss of each step, warm-ups first, the state and batches to
    go on stepping from (the state passed in is donated: the one returned is live), and the
    seconds the state's creation took."""
    from t5scale.data.synthetic import synthetic_batch

    started = time.perf_counter()
    state = setup.create_state()
    setup_s = time.perf_counter() - started  # the init's compile and run (where a wall goes)
    batches = [
        jax.device_put(
            synthetic_batch(run.data, run.train.batch_size, run.model.vocab_size, 0, i),
            setup.batch_sharding(),
        )
        for i in range(3)
    ]
    seconds, losses = [], []
    for i in range(shapes.warmup_steps + shapes.timed_steps):
        start = time.perf_counter()
        state, metrics = step.compiled(state, batches[i % len(batches)])
        jax.block_until_ready((state, metrics))
        seconds.append(time.perf_counter() - start)
        losses.append(float(metrics.loss))  # after the clock: the step is done
        if sum(seconds) > TIMED_STEPS_S and i >= shapes.warmup_steps + 2:
            break  # a step far slower than expected: three timed steps say so, and save time
    return seconds, losses, state, batches, setup_s


def _write_back_to_back(results: Results, jax, step, state, batches, shapes: Shapes,
                        step_s: float):  # fmt: skip
    """The mean of `timed_steps` steps dispatched back to back, waited for once, as a training
    loop runs them (the timed steps wait for each: the host's work between two steps is in
    their time, not hidden behind the device's), written; the state to go on from. Not for a
    step the timed loop cut short."""
    steps = shapes.timed_steps
    if step_s * steps > TIMED_STEPS_S:
        return state
    start = time.perf_counter()
    for i in range(steps):
        state, metrics = step.compiled(state, batches[i % len(batches)])
    jax.block_until_ready((state, metrics))
    results.write(back_to_back_s=(time.perf_counter() - start) / steps)
    return state


def _write_times(
    results: Results,
    setup,
    run,
    shapes: Shapes,
    peak: float | None,
    seconds: list[float],
    losses: list[float],
) -> float:
    """The timed steps' median, tokens/s and MFU, written; the median."""
    from t5scale.analysis.flops import mfu, training_flops_per_step
    from t5scale.analysis.memory import allocator_peak
    from t5scale.analysis.peaks import datasheet_peak

    timed_s = seconds[shapes.warmup_steps :]
    step_s = statistics.median(timed_s)
    tokens = run.train.batch_size * (run.data.input_length + run.data.target_length)
    flops = training_flops_per_step(run.model, run.train.batch_size, run.data.input_length,
                                    run.data.target_length)  # fmt: skip
    datasheet = datasheet_peak(run.model.dtype)
    results.write(
        step_s=step_s, steps_s=timed_s, warmup_s=seconds[: shapes.warmup_steps],
        tokens_per_s=tokens / step_s, loss=losses[-1], losses=losses,
        mfu_measured_peak=mfu(flops, step_s, peak, 1) if peak else None,
        mfu_datasheet=mfu(flops, step_s, datasheet, 1) if datasheet else None,
        allocator_peak_bytes=allocator_peak(setup.mesh),
    )  # fmt: skip
    return step_s


def _write_prediction(results: Results, device, program, run, step_s: float) -> None:
    """The cluster model's step for the card's program (or the H100's), and its error."""
    # The program itself, so that what the model made of it can be read again without a GPU.
    with zipfile.ZipFile(results.path.parent / "programs.zip", "a", zipfile.ZIP_DEFLATED) as z:
        z.writestr(results.item.replace(" ", "_") + ".hlo.txt", program.compiled.as_text())
    from t5scale.whatif.gpu_step import predict_program
    from t5scale.whatif.step_time import predict_from_program

    analysis, cluster = program.analysis, cluster_for(device)
    predicted = predict_from_program(analysis, run.model, cluster)
    timed = predict_program(analysis.program, cluster, 1)
    results.write(
        predicted_step_s=predicted.step_s, predicted_compute_s=predicted.compute_s,
        predicted_by_class_s=timed.compute_by_class_s, predicted_launch_s=timed.launch_s,
        prediction_error=predicted.step_s / step_s - 1, cluster=cluster.name,
        kernels={kind: getattr(analysis.kernels, kind).count
                 for kind in ("gemm", "attention", "fusion", "copy")},
    )  # fmt: skip


def step_run(shapes: Shapes, model: str, remat: str, attention: str, scan_layers: bool,
             batch: int | None = None, loss_chunk_tokens: int | None = None,
             precision: str = "mixed", logits_dtype: str = "float32",
             head_kernel: bool = False):  # fmt: skip
    """The timed run: mixed precision (or `precision`: 'fp8'), AdamW without clipping (as
    bench/bench_step.py), at the shapes' batch or `batch`, the loss in chunks of
    `loss_chunk_tokens` (None: chosen), the logits written in `logits_dtype`, or with
    `head_kernel` not written (ModelConfig.head_kernel)."""
    from t5scale.data.config import DataConfig
    from t5scale.model.sizes import preset
    from t5scale.train.config import RunConfig, TrainConfig
    from t5scale.train.optim import OptimizerConfig
    from t5scale.train.precision import PrecisionConfig

    model_config = dataclasses.replace(preset(model), dtype="bfloat16", remat=remat,
                                       attention=attention, scan_layers=scan_layers,
                                       loss_chunk_tokens=loss_chunk_tokens,
                                       logits_dtype=logits_dtype,
                                       head_kernel=head_kernel)  # fmt: skip
    return RunConfig(
        model=model_config,
        optimizer=OptimizerConfig(grad_clip_norm=None),
        train=TrainConfig(batch_size=batch or shapes.batch),
        data=DataConfig(input_length=shapes.input_length, target_length=shapes.target_length),
        precision=PrecisionConfig(mode=precision),
    )


def h100_target():
    """One H100 to compile for without one (XLA:GPU through jax's CUDA plugin), or None where
    the plugin is missing."""
    from t5scale import xla_gpu
    from t5scale.startup import cuda_plugin_installed
    from t5scale.target import Target

    if not cuda_plugin_installed():
        return None
    return Target.compile_only_gpus(xla_gpu.GpuTopology("h100_sxm", nodes=1, gpus_per_node=1))


def h100_program(run):
    """The dry run's stand-in for the card's program: the same run compiled for one H100
    without one, or None where jax's CUDA plugin is missing."""
    from t5scale.train.setup import build_setup

    target = h100_target()
    return None if target is None else build_setup(run, target).compile()


def cluster_for(device):
    """The cluster file of this GPU: gin/clusters/h200.gin on an H200, else h100.gin."""
    kind = getattr(device, "device_kind", "")
    return cluster_from(ROOT / f"gin/clusters/{'h200' if 'H200' in kind else 'h100'}.gin")


def cluster_from(path: Path):
    """The cluster a gin file describes, as the cluster model reads it."""
    from t5scale.config import build_hardware, parse_gin

    parse_gin([str(path)], [])
    return build_hardware(required=True)


def predict_h100(analysis, run) -> float:
    from t5scale.whatif.step_time import predict_from_program

    return predict_from_program(analysis, run.model, cluster_for(None)).step_s
