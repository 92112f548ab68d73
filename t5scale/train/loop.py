"""The training loop: config → setup (mesh, the state's form) → state (fresh or restored) →
compiled step → steps.

A run with a MODEL_DIR checkpoints there (t5scale/train/checkpoint.py) and, started again with
the same command, resumes from its newest good checkpoint: the same state, the data stream at
the same position, metrics.jsonl cut back to that step. SIGTERM saves at the next step boundary
and ends the run normally.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from t5scale.analysis.records import StepAnalysis
from t5scale.data.loader import Batches
from t5scale.errors import ConfigError, Interrupted
from t5scale.parallel.mesh import describe_mesh
from t5scale.train import optim
from t5scale.train.config import RunConfig
from t5scale.train.instruments import Instruments
from t5scale.train.metrics import MetricsLog, StepMeasures, StepMetrics, StepRecord
from t5scale.train.profiling import step_annotation
from t5scale.train.setup import CompiledStep, Setup, build_setup


class NonFiniteError(FloatingPointError):
    """A NaN or Inf loss or gradient with CheckpointConfig.on_nonfinite = 'stop'."""


def train(run: RunConfig, operative_config: str | None = None, devices=None) -> list[StepRecord]:
    """Train up to run.train.steps steps; return this call's records (metrics.jsonl's)."""
    cfg = run.train
    setup = build_setup(run, devices)
    _announce(run, setup)
    checkpoints, restored = None, None
    if cfg.model_dir:
        from t5scale.train.checkpoint import Checkpoints  # orbax: only runs that save

        checkpoints = Checkpoints(cfg.model_dir, run.checkpoint)
        restored = checkpoints.restore_latest(
            setup.form.restore_target, run.model, run.optimizer.name
        )
    start = restored.meta.step if restored else 0
    primary = jax.process_index() == 0  # writes the run's files and shows progress
    if start >= cfg.steps:
        if primary:
            where = f"{cfg.model_dir} holds a checkpoint at step {start} of {cfg.steps}"
            print(f"{where if restored else f'TrainConfig.steps is {cfg.steps}'}: nothing to do")
        if checkpoints:
            checkpoints.close()
        return []
    if restored and primary:
        print(f"resuming from the checkpoint at step {start}", flush=True)
    # The input pipelines start first: they build on their own threads while the state is
    # created and the step compiles.
    batches, held_out = _input_pipelines(run, setup, restored.meta.data_position if restored else 0)
    try:
        if restored:
            state = setup.form.from_canonical(restored.state, restored.meta)
        else:
            state = setup.create_state()
        single_step = setup.compile()
        setup = single_step.setup  # with remat 'auto': the policy chosen
        programs = StepPrograms(run, setup, single_step)
        if cfg.steps_per_execution > 1:
            programs.multi_step = setup.compile(cfg.steps_per_execution)
        evaluate = validation_loss(setup, held_out) if held_out else None
        if primary:
            _write_run_files(cfg.model_dir, operative_config, single_step.analysis)
        saver = _Saver(checkpoints, setup, run)
        instruments = Instruments(run, setup.mesh, single_step.analysis)
        with _Preemption() as preemption:
            return _run_steps(
                run, state, start, programs, evaluate, batches, saver, preemption, instruments
            )
    finally:
        batches.close()
        if held_out:
            held_out.close()
        if checkpoints:
            checkpoints.close()  # waits for a save in flight


def _input_pipelines(run: RunConfig, setup: Setup, start: int) -> tuple[Batches, Batches | None]:
    """The training batches from `start`, and the held-out ones where validation is due."""
    cfg, sharding = run.train, setup.batch_sharding()
    batches = Batches(
        run.data, cfg.batch_size, cfg.seed, run.model.vocab_size, sharding, start=start
    )
    if not run.data.validation_every:
        return batches, None
    held_out = Batches(
        run.data, cfg.batch_size, cfg.seed, run.model.vocab_size, sharding, split="validation"
    )
    return batches, held_out


def _announce(run: RunConfig, setup: Setup) -> None:
    """The mesh, and local SGD's or DiLoCo's replicas (refused with fewer than two)."""
    replicas = setup.layout.replicas
    if run.sync.local and replicas < 2:  # else it trains synchronously
        raise ConfigError(
            f"ReplicaSyncConfig.mode {run.sync.mode} needs replica >= 2, the mesh has "
            f"replica={replicas} (set ParallelConfig.replica)"
        )
    print(f"process {jax.process_index()}: {describe_mesh(setup.mesh, run.parallel)}", flush=True)
    if run.sync.local and jax.process_index() == 0:
        print(f"{run.sync.mode}: {replicas} replicas step on their own and synchronise every "
              f"{run.sync.every} steps", flush=True)  # fmt: skip


class StepPrograms:
    """The compiled one-step program and, with steps_per_execution k > 1, the k-step one.

    `steps_in_next_execution(done)` is how many steps the next execution takes after `done`
    steps: k when none of the next k - 1 steps is followed by a checkpoint, a validation or the
    end of the run (they must see the state of their own step), else 1.
    """

    def __init__(self, run: RunConfig, setup: Setup | None, single_step: CompiledStep | None):
        self.run, self.setup, self.single_step = run, setup, single_step
        self.multi_step: CompiledStep | None = None

    def steps_in_next_execution(self, done: int) -> int:
        run, steps = self.run, self.run.train.steps_per_execution
        if self.multi_step is None or done + steps > run.train.steps:
            return 1
        inside = range(done + 1, done + steps)
        stops = (
            _checkpoint_due(run, s) or _validation_due(run, s) or run.sync.due(s) for s in inside
        )
        return 1 if any(stops) else steps

    def execute(self, state, batches: list, done: int) -> tuple[Any, StepMetrics]:
        """(state, metrics) after len(batches) steps after `done`, by the program of that many
        steps (CompiledStep.execute); with several, a value per step each."""
        if len(batches) == 1:
            return self.single_step.execute(state, batches[0], done)
        return self.multi_step.execute(state, self.setup.stack(batches), done)


def _checkpoint_due(run: RunConfig, step: int) -> bool:
    every = run.checkpoint.every
    return bool(every and step % every == 0) or step == run.train.steps


def _validation_due(run: RunConfig, step: int) -> bool:
    every = run.data.validation_every
    return bool(every) and (step % every == 0 or step == run.train.steps)


def _write_run_files(
    model_dir: str | None, operative_config: str | None, analysis: StepAnalysis
) -> None:
    if not model_dir:
        return
    Path(model_dir).mkdir(parents=True, exist_ok=True)
    if operative_config is not None:
        Path(model_dir, "config.gin").write_text(operative_config, encoding="utf-8")
    Path(model_dir, "step_analysis.json").write_text(
        json.dumps(analysis.to_json(), indent=2) + "\n"
    )


def validation_loss(setup: Setup, held_out: Batches):
    """evaluate(state) → mean validation loss over the first batches of the held-out split."""
    data = setup.run.data
    batches = [b for _, b in zip(range(data.validation_batches), held_out, strict=False)]
    if not batches:
        raise ConfigError(f"the validation split of {data.source!r} data yields no full batch")
    eval_step = setup.eval_step()

    def evaluate(state) -> float:
        params = setup.model_params(state)
        # Every device's part done (device_get reads one copy of a replicated sum): a process
        # must not exit with a device still in a cross-process step (t5scale/cli.py's check).
        sums = [
            jax.device_get(jax.block_until_ready(eval_step(params, state.fp8, batch)))
            for batch in batches
        ]
        total = sum(float(s.cross_entropy + s.z_loss) for s in sums)
        return total / max(sum(float(s.target_tokens) for s in sums), 1.0)

    return evaluate


class _Saver:
    """Saves checkpoints (the state's canonical form) on the schedule, each with `run` in its
    meta (as configured: the setup's may have chosen a remat policy or an attention kernel for
    these devices); remembers the last step saved."""

    def __init__(self, checkpoints, setup: Setup, run: RunConfig):
        self.checkpoints, self.setup, self.run = checkpoints, setup, run
        self.last_saved: int | None = None

    def due(self, step: int) -> bool:
        return _checkpoint_due(self.setup.run, step)

    def save(self, step: int, state, data_position: int) -> None:
        if self.checkpoints is None:
            return
        from t5scale.train.checkpoint import saved_meta  # orbax: only runs that save

        meta = saved_meta(self.run, self.setup.form, step, data_position)
        self.checkpoints.save(step, self.setup.form.to_canonical(state), meta)
        self.last_saved = step


class _Preemption:
    """SIGTERM → the loop saves at the next step boundary and returns; on one process Ctrl-C
    (SIGINT) too, and then the run ends as Interrupted (exit code 130); a second Ctrl-C is the
    caller's (the CLI's stops at once; Python's raises KeyboardInterrupt).

    On several processes the signal may reach them at different steps, and a checkpoint is
    written by all of them together: JAX's preemption sync manager (which catches SIGTERM
    itself) makes them agree on the step.
    """

    def __init__(self):
        self.requested = False
        self.interrupted = False  # by Ctrl-C
        self._previous: dict[int, Any] = {}
        self._agreed = jax.process_count() > 1

    def __enter__(self) -> _Preemption:
        if self._agreed:
            return self
        if threading.current_thread() is threading.main_thread():  # signals reach only it
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step`; the same answer on every process."""
        if self._agreed:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:  # the caller's handler: the CLI's stops at once, Python's raises
                previous = self._previous[signum]
                if not callable(previous):
                    raise KeyboardInterrupt
                previous(signum, frame)
                return
            self.interrupted = True
            print("\nt5scale: Ctrl-C: stopping after this step with a checkpoint "
                  "(Ctrl-C again stops at once)", file=sys.stderr, flush=True)  # fmt: skip
        self.requested = True

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _settles(run: RunConfig, step: int) -> bool:
    """Whether the host waits for `step` before it dispatches the next: it needs that step's
    state (a checkpoint, a validation, the run's end) or a quiet device (a profile's bounds).
    Local SGD and DiLoCo always: their dispatch itself waits for the replicas' metrics (an
    all-gather across processes), so a step dispatched ahead would take the last one's time."""
    first, last = run.train.profile_steps or (0, 0)
    due = _checkpoint_due(run, step) or _validation_due(run, step)
    return run.sync.local or due or step in (first - 1, last)


@dataclasses.dataclass(frozen=True)
class _Execution:
    """An execution on its way: the steps after `done`, its metrics (on the device until read)
    and when its time began (its dispatch; the last one's end where that came later)."""

    done: int
    steps: int
    metrics: Any
    dispatched_at: float


class _InFlight:
    """The executions dispatched and not yet read, at most two: the next goes to the device
    before the last one's metrics are read (as MaxText's and t5x's loops run), so the device
    never waits for the host between steps, except where the host needs a step's state
    (`_settles`) or asked to stop. `state` is the newest dispatched execution's."""

    def __init__(self, run: RunConfig, programs: StepPrograms, batches, instruments, state,
                 start: int):  # fmt: skip
        self.run, self.programs = run, programs
        self.batches, self.instruments = batches, instruments
        self.state, self.dispatched = state, start
        self.executions: list[_Execution] = []
        self.last_read = 0.0

    def may_dispatch(self, preempted: bool) -> bool:
        waiting = self.executions and _settles(self.run, self.dispatched)
        return self.dispatched < self.run.train.steps and not preempted and not waiting

    def dispatch(self) -> bool:
        """Dispatch the next execution; whether to dispatch another before reading it."""
        done = self.dispatched
        executed = self.programs.steps_in_next_execution(done)
        chunk = [next(self.batches) for _ in range(executed)]  # the next prefetch
        self.instruments.before(done + 1, done + executed)
        started = time.perf_counter()
        with step_annotation(done + 1):
            self.state, metrics = self.programs.execute(self.state, chunk, done)
        self.executions.append(_Execution(done, executed, metrics, started))
        self.dispatched += executed
        return len(self.executions) == 1 and self.may_dispatch(preempted=False)

    def read(self) -> tuple[_Execution, StepMetrics, float]:
        """The oldest execution, its metrics on the host and its time per step."""
        execution = self.executions.pop(0)
        metrics = jax.device_get(jax.block_until_ready(execution.metrics))
        now = time.perf_counter()
        # Steps of one execution share its time equally: it is all there is to measure.
        elapsed = (now - max(execution.dispatched_at, self.last_read)) / execution.steps
        self.last_read = now
        self.instruments.after(execution.done + execution.steps)
        return execution, metrics, elapsed


def _run_steps(
    run, state, start, programs, evaluate, batches, saver, preemption, instruments
) -> list[StepRecord]:
    cfg = run.train
    primary = jax.process_index() == 0
    log = MetricsLog(
        cfg.model_dir if primary else None, cfg.steps, cfg.log_every, resume_at=start, show=primary
    )
    history, skipped, preempted = [], 0, False
    flight = _InFlight(run, programs, batches, instruments, state, start)
    try:
        while flight.dispatched < cfg.steps or flight.executions:
            if flight.may_dispatch(preempted) and flight.dispatch():
                continue  # the next goes to the device before this one is read
            execution, metrics, elapsed = flight.read()
            measures = instruments.measures(elapsed)
            for record in _step_records(run, execution.done, metrics, elapsed, measures):
                if record.nonfinite and run.checkpoint.on_nonfinite == "stop":
                    log.write(record)
                    raise _nonfinite_error(record, saver.last_saved)
                skipped += record.nonfinite > 0  # the step already left the state as it was
                record = dataclasses.replace(record, skipped_steps=skipped)
                if evaluate and _validation_due(run, record.step):
                    # a settling step: nothing after it dispatched (local SGD, DiLoCo: the last
                    # synchronised parameters)
                    record = dataclasses.replace(record, validation_loss=evaluate(flight.state))
                log.write(record)
                instruments.write(record)
                history.append(record)
                preempted = preemption.reached(record.step) or preempted  # asked every step
            if flight.executions:
                continue  # a later step is on its way: no checkpoint here
            jax.block_until_ready(flight.state)  # every device's part done: a save, or the exit
            if _stopped(saver, flight.state, batches, flight.dispatched, preempted, preemption,
                        cfg.steps):  # fmt: skip
                break
    finally:
        log.close()
        instruments.close()
    return history


def _stopped(saver, state, batches, done: int, preempted: bool, preemption, steps: int) -> bool:
    """At a step boundary with nothing in flight: save where due or asked; whether the run stops
    here (SIGTERM: saved, it ends normally; Ctrl-C: Interrupted)."""
    if saver.due(done) or preempted:
        saver.save(done, state, batches.position)
    if preempted and preemption.interrupted and done < steps:
        raise Interrupted(
            f"interrupted (Ctrl-C) after step {done} of {steps}: "
            + ("checkpoint saved; the same command resumes from it"
               if saver.last_saved == done else "no MODEL_DIR, nothing saved")
        )  # fmt: skip
    if preempted and done < steps:
        print(
            f"preempted (SIGTERM): checkpoint saved at step {done}; "
            "the same command resumes from it",
            flush=True,
        )
        return True
    return False


def _step_records(
    run: RunConfig, done: int, metrics: StepMetrics, step_time_s: float, measures: StepMeasures
) -> list[StepRecord]:
    """metrics.jsonl's records of the steps after `done` that one execution took (on the host);
    they share its time and measures."""
    return [
        StepRecord.of(
            step,
            of_step,
            learning_rate=optim.learning_rate_at(run.optimizer, step - 1),
            step_time_s=step_time_s,
            tokens_per_s=run.tokens_per_step / step_time_s,
            measures=measures,
        )
        for step, of_step in enumerate(metrics.per_step(), start=done + 1)
    ]


def _nonfinite_error(record: StepRecord, last_saved: int | None) -> NonFiniteError:
    kept = f"step {last_saved}" if last_saved else "none this run"
    return NonFiniteError(
        f"loss {record.loss}, gradient norm {record.grad_norm} at step {record.step}: "
        f"stopped without saving (last checkpoint: {kept}); "
        "CheckpointConfig.on_nonfinite='skip' skips such steps"
    )
