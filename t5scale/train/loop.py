"""The training loop: config → mesh → plan → state → compiled step → steps → metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np

from t5scale.analysis.step import analyze_step
from t5scale.data.synthetic import synthetic_batch
from t5scale.parallel.mesh import data_parallel_size, make_mesh
from t5scale.train import optim
from t5scale.train.config import ConfigError, RunConfig
from t5scale.train.metrics import MetricsLog
from t5scale.train.state import abstract_state, create_state, plan_for, state_shardings
from t5scale.train.step import LossConfig, batch_sharding, make_train_step


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
    cfg, model_dir = run.train, run.train.model_dir
    mesh = make_mesh(run.parallel, devices)
    check_batch(run, mesh)
    tx = optim.make_optimizer(run.optimizer)
    schedule = optim.inverse_sqrt_schedule(run.optimizer)
    plan = plan_for(run.model, run.parallel.zero_stage, mesh)
    shardings = state_shardings(plan, tx, abstract_state(run.model, tx))
    state = create_state(run.model, tx, plan, cfg.seed)
    step_fn = make_train_step(
        run.model, plan, tx, shardings, cfg.micro_batches, LossConfig(cfg.z_loss)
    )

    def device_batch(step: int):
        batch = synthetic_batch(run.data, cfg.batch_size, run.model.vocab_size, cfg.seed, step)
        return jax.device_put(batch, batch_sharding(plan))

    started = time.perf_counter()
    compiled = step_fn.lower(state, device_batch(0)).compile()
    analysis = analyze_step(compiled, run, plan, tx, compile_time_s=time.perf_counter() - started)
    if model_dir:
        Path(model_dir).mkdir(parents=True, exist_ok=True)
        if operative_config is not None:
            Path(model_dir, "config.gin").write_text(operative_config, encoding="utf-8")
        Path(model_dir, "step_analysis.json").write_text(json.dumps(analysis, indent=2) + "\n")

    tokens_per_step = cfg.batch_size * (run.data.input_length + run.data.target_length)
    log, history = MetricsLog(model_dir, cfg.steps, cfg.log_every), []
    next_batch = device_batch(0)
    for step in range(cfg.steps):
        batch, started = next_batch, time.perf_counter()
        state, metrics = compiled(state, batch)
        if step + 1 < cfg.steps:  # prepare the next batch while the device works
            next_batch = device_batch(step + 1)
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
        log.write(record)
        history.append(record)
    log.close()
    return history
