"""The training loop: config → mesh → plan → state (fresh or restored) → compiled step → steps.

A run with a MODEL_DIR checkpoints there (t5scale/train/checkpoint.py) and, started again with
the same command, resumes from its newest good checkpoint: the same state, the data stream at
the same position, metrics.jsonl cut back to that step. SIGTERM saves at the next step boundary
and ends the run normally.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np

from t5scale.analysis.step import analyze_step
from t5scale.data.loader import Batches
from t5scale.data.synthetic import batch_shapes
from t5scale.parallel.mesh import data_parallel_size, describe_mesh, make_mesh
from t5scale.train import optim
from t5scale.train.config import ConfigError, RunConfig
from t5scale.train.metrics import MetricsLog
from t5scale.train.state import (
    abstract_state,
    create_state,
    plan_for,
    sharded_abstract_state,
    state_shardings,
)
from t5scale.train.step import (
    LossConfig,
    batch_sharding,
    make_eval_step,
    make_train_step,
    stack_batches,
)


class NonFiniteError(FloatingPointError):
    """A NaN or Inf loss or gradient with CheckpointConfig.on_nonfinite = 'stop'."""


def check_batch(run: RunConfig, mesh) -> None:
    data_parallel = data_parallel_size(mesh)
    needed = data_parallel * run.train.micro_batches
    if run.train.batch_size % needed:
        raise ConfigError(
            f"global batch {run.train.batch_size} is not divisible by data-parallel size "
            f"{data_parallel} × micro_batches {run.train.micro_batches} = {needed}"
        )


def train(run: RunConfig, operative_config: str | None = None, devices=None) -> list[dict]:
    """Train up to run.train.steps steps; return this call's per-step metrics."""
    cfg = run.train
    mesh = make_mesh(run.parallel, devices)
    print(f"process {jax.process_index()}: {describe_mesh(mesh, run.parallel)}", flush=True)
    check_batch(run, mesh)
    tx = optim.make_optimizer(run.optimizer)
    plan = plan_for(run.model, run.parallel.zero_stage, mesh)
    abstract = abstract_state(run.model, tx)
    shardings = state_shardings(plan, tx, abstract)
    checkpoints, restored = None, None
    if cfg.model_dir:
        from t5scale.train.checkpoint import Checkpoints  # orbax: only runs that save

        checkpoints = Checkpoints(cfg.model_dir, run.checkpoint)
        target = sharded_abstract_state(abstract, shardings)
        restored = checkpoints.restore_latest(target, run.model, run.optimizer.name)
    start = restored.meta["step"] if restored else 0
    primary = jax.process_index() == 0  # writes the run's files and shows progress
    if start >= cfg.steps:
        if primary:
            print(
                f"{cfg.model_dir} holds a checkpoint at step {start} of {cfg.steps}: nothing to do"
            )
        if checkpoints:
            checkpoints.close()
        return []
    if restored and primary:
        print(f"resuming from the checkpoint at step {start}", flush=True)
    # The input pipelines start first: they build on their own threads while the state is
    # created and the step compiles.
    batches = Batches(
        run.data, cfg.batch_size, cfg.seed, run.model.vocab_size, batch_sharding(plan),
        start=restored.meta["data_position"] if restored else 0,
    )  # fmt: skip
    held_out = None
    if run.data.validation_every:
        held_out = Batches(
            run.data, cfg.batch_size, cfg.seed, run.model.vocab_size, batch_sharding(plan),
            split="validation",
        )  # fmt: skip
    try:
        state = restored.state if restored else create_state(run.model, tx, plan, cfg.seed)
        skip = run.checkpoint.on_nonfinite == "skip"
        compiled, analysis = compile_train_step(run, plan, tx, abstract, shardings, skip)
        programs = StepPrograms(run, plan, compiled)
        if cfg.steps_per_execution > 1:
            programs.many = compile_steps(run, plan, tx, abstract, shardings, skip)
        evaluate = validation_loss(run, plan, held_out) if held_out else None
        if primary:
            _write_run_files(cfg.model_dir, operative_config, analysis)
        saver = _Saver(checkpoints, run, operative_config)
        with _Preemption() as preemption:
            return _run_steps(run, state, start, programs, evaluate, batches, saver, preemption)
    finally:
        batches.close()
        if held_out:
            held_out.close()
        if checkpoints:
            checkpoints.close()  # waits for a save in flight


def compile_train_step(run: RunConfig, plan, tx, abstract, shardings, skip_nonfinite=False):
    """(compiled step, step_analysis.json's dict), lowered from abstract shapes in their
    shardings (nothing allocated): for the training loop and the study's trials alike."""
    started = time.perf_counter()
    compiled = compile_steps(run, plan, tx, abstract, shardings, skip_nonfinite, 1)
    return compiled, analyze_step(compiled, run, plan, tx, time.perf_counter() - started)


def compile_steps(run: RunConfig, plan, tx, abstract, shardings, skip_nonfinite=False, steps=None):
    """The compiled program of `steps` training steps per execution (default
    TrainConfig.steps_per_execution), from abstract shapes. step_analysis.json and memory checks
    use the one-step program: XLA's memory analysis of the k-step loop can under-count its
    temporaries (bench/bench_step.py)."""
    steps = run.train.steps_per_execution if steps is None else steps
    program = make_train_step(
        run.model, plan, tx, shardings, run.train.micro_batches, LossConfig(run.train.z_loss),
        skip_nonfinite=skip_nonfinite, steps_per_execution=steps,
    )  # fmt: skip
    state = sharded_abstract_state(abstract, shardings)
    return program.lower(state, abstract_batch(run, plan, steps)).compile()


def abstract_batch(run: RunConfig, plan, steps: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch's shapes and sharding (`steps` > 1: that many stacked), to compile the
    step before any data arrive."""
    stack = (steps,) if steps > 1 else ()
    return {
        name: jax.ShapeDtypeStruct(
            stack + shape, np.int32, sharding=batch_sharding(plan, steps > 1)
        )
        for name, shape in batch_shapes(run.data, run.train.batch_size).items()
    }


class StepPrograms:
    """The compiled one-step program and, with steps_per_execution k > 1, the k-step one.

    `chunk(done)` is how many steps the next execution takes after `done` steps: k when none of
    the next k - 1 steps is followed by a checkpoint, a validation or the end of the run (they
    must see the state of their own step), else 1.
    """

    def __init__(self, run: RunConfig, plan, one):
        self.run, self.plan, self.one, self.many = run, plan, one, None

    def chunk(self, done: int) -> int:
        k, run = self.run.train.steps_per_execution, self.run
        if self.many is None or done + k > run.train.steps:
            return 1
        stops = (
            _checkpoint_due(run, s) or _validation_due(run, s) for s in range(done + 1, done + k)
        )
        return 1 if any(stops) else k

    def execute(self, state, batches: list) -> tuple:
        """(state, metrics) after len(batches) steps; with several, a value per step each."""
        if len(batches) == 1:
            return self.one(state, batches[0])
        return self.many(state, stack_batches(batches, self.plan))


def _checkpoint_due(run: RunConfig, step: int) -> bool:
    every = run.checkpoint.every
    return bool(every and step % every == 0) or step == run.train.steps


def _validation_due(run: RunConfig, step: int) -> bool:
    every = run.data.validation_every
    return bool(every) and (step % every == 0 or step == run.train.steps)


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


class _Saver:
    """Saves checkpoints on the schedule; remembers the last step saved."""

    def __init__(self, checkpoints, run: RunConfig, operative_config: str | None):
        self.checkpoints, self.run, self.gin = checkpoints, run, operative_config or ""
        self.last_saved: int | None = None

    def due(self, step: int) -> bool:
        return _checkpoint_due(self.run, step)

    def save(self, step: int, state, data_position: int) -> None:
        if self.checkpoints is None:
            return
        from t5scale.train.checkpoint import model_signature

        meta = {
            "step": step,
            "data_position": data_position,
            "seed": self.run.train.seed,
            "model": model_signature(self.run.model),
            "optimizer": self.run.optimizer.name,
            "gin": self.gin,
        }
        self.checkpoints.save(step, state, meta)
        self.last_saved = step


class _Preemption:
    """SIGTERM → the loop saves at the next step boundary and returns.

    On several processes the signal may reach them at different steps, and a checkpoint is
    written by all of them together: JAX's preemption sync manager (which catches SIGTERM
    itself) makes them agree on the step.
    """

    def __init__(self):
        self.requested = False
        self._previous = None
        self._agreed = jax.process_count() > 1

    def __enter__(self) -> _Preemption:
        if self._agreed:
            return self
        if threading.current_thread() is threading.main_thread():  # signals reach only it
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step`; the same answer on every process."""
        if self._agreed:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _run_steps(run, state, start, programs, evaluate, batches, saver, preemption) -> list[dict]:
    cfg = run.train
    schedule = optim.inverse_sqrt_schedule(run.optimizer)
    tokens_per_step = cfg.batch_size * (run.data.input_length + run.data.target_length)
    primary = jax.process_index() == 0
    log = MetricsLog(
        cfg.model_dir if primary else None, cfg.steps, cfg.log_every, resume_at=start, show=primary
    )
    history, skipped, done = [], 0, start
    try:
        while done < cfg.steps:
            chunk = [next(batches) for _ in range(programs.chunk(done))]  # the next prefetch
            started = time.perf_counter()
            state, metrics = programs.execute(state, chunk)
            metrics = jax.device_get(jax.block_until_ready((state, metrics))[1])
            metrics = {name: np.atleast_1d(value) for name, value in metrics.items()}
            # Steps of one execution share its time equally: it is all there is to measure.
            elapsed = (time.perf_counter() - started) / len(chunk)
            preempted = False
            for i in range(len(chunk)):
                step = done + i + 1
                record = {"step": step, **{k: float(v[i]) for k, v in metrics.items()}}
                record |= {
                    "learning_rate": float(schedule(step - 1)),
                    "step_time_s": elapsed,
                    "tokens_per_s": tokens_per_step / elapsed,
                }
                finite = np.isfinite(record["loss"]) and np.isfinite(record["grad_norm"])
                if not finite and run.checkpoint.on_nonfinite == "stop":
                    log.write(record)
                    kept = f"step {saver.last_saved}" if saver.last_saved else "none this run"
                    raise NonFiniteError(
                        f"loss {record['loss']}, gradient norm {record['grad_norm']} at step "
                        f"{step}: stopped without saving (last checkpoint: {kept}); "
                        "CheckpointConfig.on_nonfinite='skip' skips such steps"
                    )
                skipped += not finite
                record["skipped_steps"] = skipped
                if evaluate and _validation_due(run, step):
                    record["validation_loss"] = evaluate(state.params)  # a chunk's last step
                log.write(record)
                history.append(record)
                preempted = preemption.reached(step) or preempted  # asked at every step
            done += len(chunk)
            if saver.due(done) or preempted:
                saver.save(done, state, batches.position)
            if preempted and done < cfg.steps:
                print(
                    f"preempted (SIGTERM): checkpoint saved at step {done}; "
                    "the same command resumes from it",
                    flush=True,
                )
                break
    finally:
        log.close()
    return history
