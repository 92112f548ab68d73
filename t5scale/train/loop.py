"""The training loop: config → mesh → plan → state → compiled step → steps → metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np

from t5scale.analysis.step import analyze_step
from t5scale.data.loader import Batches
from t5scale.data.synthetic import batch_shapes
from t5scale.parallel.mesh import data_parallel_size, make_mesh
from t5scale.train import optim
from t5scale.train.config import ConfigError, RunConfig
from t5scale.train.metrics import MetricsLog
from t5scale.train.state import abstract_state, create_state, plan_for, state_shardings
from t5scale.train.step import LossConfig, batch_sharding, make_eval_step, make_train_step


def check_batch(run: RunConfig, mesh) -> None:
    data_parallel = data_parallel_size(mesh)
    needed = data_parallel * run.train.micro_batches
    if run.train.batch_size % needed:
        raise ConfigError(
            f"global batch {run.train.batch_size} is not divisible by data-parallel size "
            f"{data_parallel} × micro_batches {run.train.micro_batches} = {needed}"
        )


def train(run: RunConfig, operative_config: str | None = None, devices=None) -> list[dict]:
    """Train for run.train.steps steps; return the per-step metrics (also in metrics.jsonl)."""
    cfg = run.train
    mesh = make_mesh(run.parallel, devices)
    check_batch(run, mesh)
    tx = optim.make_optimizer(run.optimizer)
    plan = plan_for(run.model, run.parallel.zero_stage, mesh)
    shardings = state_shardings(plan, tx, abstract_state(run.model, tx))
    # The input pipelines start first: they build on their own threads while the state is
    # created and the step compiles.
    batches = Batches(
        run.data, cfg.batch_size, cfg.seed, run.model.vocab_size, batch_sharding(plan)
    )
    held_out = None
    if run.data.validation_every:
        held_out = Batches(
            run.data, cfg.batch_size, cfg.seed, run.model.vocab_size, batch_sharding(plan),
            split="validation",
        )  # fmt: skip
    try:
        state = create_state(run.model, tx, plan, cfg.seed)
        step_fn = make_train_step(
            run.model, plan, tx, shardings, cfg.micro_batches, LossConfig(cfg.z_loss)
        )
        started = time.perf_counter()
        compiled = step_fn.lower(state, abstract_batch(run, plan)).compile()
        analysis = analyze_step(
            compiled, run, plan, tx, compile_time_s=time.perf_counter() - started
        )
        evaluate = validation_loss(run, plan, held_out) if held_out else None
        _write_run_files(cfg.model_dir, operative_config, analysis)
        return _run_steps(run, state, compiled, evaluate, batches)
    finally:
        batches.close()
        if held_out:
            held_out.close()


def abstract_batch(run: RunConfig, plan) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch's shapes and sharding, to compile the step before any data arrive."""
    return {
        name: jax.ShapeDtypeStruct(shape, np.int32, sharding=batch_sharding(plan))
        for name, shape in batch_shapes(run.data, run.train.batch_size).items()
    }


def _write_run_files(model_dir: str | None, operative_config: str | None, analysis: dict) -> None:
    if not model_dir:
        return
    Path(model_dir).mkdir(parents=True, exist_ok=True)
    if operative_config is not None:
        Path(model_dir, "config.gin").write_text(operative_config, encoding="utf-8")
    Path(model_dir, "step_analysis.json").write_text(json.dumps(analysis, indent=2) + "\n")


def validation_loss(run: RunConfig, plan, held_out: Batches):
    """evaluate(params) → mean validation loss over the first batches of the held-out split."""
    data = run.data
    batches = [b for _, b in zip(range(data.validation_batches), held_out, strict=False)]
    if not batches:
        raise ConfigError(f"the validation split of {data.source!r} data yields no full batch")
    eval_step = make_eval_step(run.model, plan, LossConfig(run.train.z_loss))

    def evaluate(params) -> float:
        sums = [jax.device_get(eval_step(params, batch)) for batch in batches]
        total = sum(float(s["cross_entropy_sum"] + s["z_loss_sum"]) for s in sums)
        return total / max(sum(float(s["target_tokens"]) for s in sums), 1.0)

    return evaluate


def _run_steps(run: RunConfig, state, compiled, evaluate, batches: Batches) -> list[dict]:
    cfg, every = run.train, run.data.validation_every
    schedule = optim.inverse_sqrt_schedule(run.optimizer)
    tokens_per_step = cfg.batch_size * (run.data.input_length + run.data.target_length)
    log, history = MetricsLog(cfg.model_dir, cfg.steps, cfg.log_every), []
    for step in range(cfg.steps):
        batch = next(batches)  # the next is prefetched meanwhile
        started = time.perf_counter()
        state, metrics = compiled(state, batch)
        metrics = jax.device_get(jax.block_until_ready((state, metrics))[1])
        elapsed = time.perf_counter() - started
        record = {"step": step + 1, **{k: float(v) for k, v in metrics.items()}}
        record |= {
            "learning_rate": float(schedule(step)),
            "step_time_s": elapsed,
            "tokens_per_s": tokens_per_step / elapsed,
        }
        if not np.isfinite(record["loss"]):
            log.close()
            raise FloatingPointError(f"loss is {record['loss']} at step {step + 1}")
        if evaluate and ((step + 1) % every == 0 or step + 1 == cfg.steps):
            record["validation_loss"] = evaluate(state.params)
        log.write(record)
        history.append(record)
    log.close()
    return history
