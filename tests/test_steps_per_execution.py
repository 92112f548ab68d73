"""Several train steps per XLA execution (TrainConfig.steps_per_execution): the same steps."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import (
    TINY_ARGS,
    assert_same_parameters,
    run_cli,
    synthetic_batches,
    tiny_run,
    tiny_setup,
)

from t5scale.data.config import DataConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train import loop
from t5scale.train.config import CheckpointConfig, RunConfig, TrainConfig
from t5scale.train.loop import StepPrograms
from t5scale.train.replicas import ReplicaSyncConfig

K = 4


@pytest.mark.parametrize(
    "parallel, devices",
    [
        # CI: tests/test_multihost_training.py trains ZeRO-3 in executions of 4 steps on two
        # processes against one process's single steps
        pytest.param(ParallelConfig(), 1, marks=pytest.mark.slow),
        # ZeRO-3's gathers and reduce-scatters inside the loop over steps, with tensor sharding
        pytest.param(ParallelConfig(zero_stage=3, zero=4, tensor=2), 8, marks=pytest.mark.slow),
    ],
    ids=["1-device", "stage3-4x2"],
)
def test_k_steps_in_one_execution_are_k_single_steps(parallel, devices):
    setup = tiny_setup(parallel, devices)
    batches = synthetic_batches(setup, 0, K - 1)
    one = setup.compile().compiled
    state, one_losses = setup.create_state(seed=0), []
    for batch in batches:
        state, metrics = one(state, batch)
        one_losses.append(float(metrics.loss))
    one_params = jax.device_get(state.params)
    many = setup.compile(steps_per_execution=K).compiled
    state, metrics = many(setup.create_state(seed=0), setup.stack(batches))
    assert metrics.loss.shape == (K,)
    np.testing.assert_allclose(np.asarray(metrics.loss), one_losses, rtol=1e-5)
    assert_same_parameters(jax.device_get(state.params), one_params)


def _executions(steps: int, every: int, validate: int = 0, done: int = 0) -> list[int]:
    run = RunConfig(
        train=TrainConfig(steps=steps, steps_per_execution=K),
        checkpoint=CheckpointConfig(every=every),
        data=DataConfig(validation_every=validate),
    )
    programs = StepPrograms(run, setup=None, single_step=None)
    programs.multi_step = "the k-step program"  # only asked whether there is one
    sizes = []
    while done < steps:
        sizes.append(programs.steps_in_next_execution(done))
        done += sizes[-1]
    return sizes


def test_an_execution_never_runs_past_a_checkpoint_a_validation_or_the_end():
    assert _executions(steps=10, every=5) == [4, 1, 4, 1]
    assert _executions(steps=8, every=0) == [4, 4]
    assert _executions(steps=6, every=0) == [4, 1, 1]
    assert _executions(steps=12, every=0, validate=6) == [4, 1, 1, 4, 1, 1]
    assert _executions(steps=12, every=4, done=3) == [1, 4, 4]  # resumed off the grid


@pytest.mark.slow  # CI: k steps in one execution are k single steps (above)
def test_cli_run_in_executions_of_4_logs_and_saves_every_step_as_a_plain_run(tmp_path):
    records = {}
    for k in (1, K):
        model_dir = tmp_path / f"k{k}"
        done = run_cli(
            "train", *TINY_ARGS, "--gin.TRAIN_STEPS=6", "--gin.CHECKPOINT_EVERY=5",
            f"--gin.STEPS_PER_EXECUTION={k}", f"--gin.MODEL_DIR={model_dir}",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        lines = (model_dir / "metrics.jsonl").read_text().splitlines()
        records[k] = [json.loads(line) for line in lines]
        saved = sorted(int(p.name) for p in (model_dir / "checkpoints").iterdir() if p.is_dir())
        assert saved == [5, 6]
    assert [r["step"] for r in records[K]] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(
        [r["loss"] for r in records[K]], [r["loss"] for r in records[1]], rtol=1e-5
    )
    # The four steps of the first execution share its time.
    assert len({r["step_time_s"] for r in records[K][:4]}) == 1


PIPELINED = [
    "dispatch 1", "dispatch 2", "read 1", "dispatch 3", "read 2", "read 3",  # saved at 3
    "dispatch 4", "dispatch 5", "read 4", "dispatch 6", "read 5", "read 6",
]  # fmt: skip
ONE_BY_ONE = [f"{event} {step}" for step in range(1, 7) for event in ("dispatch", "read")]


@pytest.mark.parametrize(
    "sync, devices, events_wanted",
    [
        (ReplicaSyncConfig(), 1, PIPELINED),
        # CI: the synchronous run's order; local SGD's (its own compile, 13 s) under -m slow
        pytest.param(ReplicaSyncConfig("local_sgd", 2), 2, ONE_BY_ONE, marks=pytest.mark.slow),
    ],
    ids=["synchronous", "local SGD"],
)
def test_the_next_step_is_dispatched_before_the_last_is_read_except_at_a_checkpoint(
    tmp_path, monkeypatch, sync, devices, events_wanted
):
    """The device never waits for the host between steps (the H200 of 2026-11-29: mt5_small's
    step 49.4 ms waited for one by one, 47.4 ms back to back), but a checkpoint's step is read
    before any later one is dispatched: it saves that step's state. Local SGD's dispatch waits
    for its replicas' metrics itself: its steps go one by one, each timed alone."""
    events = []

    class Recorded(loop.Instruments):  # the real instruments, their calls in order
        # From a step's read to the next dispatch (its records, the log, a checkpoint) no value
        # goes to a device: an operation there would queue behind the step in flight and wait
        # for it (the learning rate's, on the H200 of 2026-11-29).
        guard = None

        def release(self):
            if self.guard:
                self.guard.__exit__(None, None, None)
                self.guard = None

        def before(self, first, last):
            self.release()
            events.append(f"dispatch {first}")
            super().before(first, last)

        def after(self, last):
            events.append(f"read {last}")
            super().after(last)
            self.release()
            self.guard = jax.transfer_guard_host_to_device("disallow")
            self.guard.__enter__()

        def close(self):
            self.release()
            super().close()

    monkeypatch.setattr(loop, "Instruments", Recorded)
    run = tiny_run(ParallelConfig(replica=devices), steps=6, model_dir=str(tmp_path),
                   checkpoint=CheckpointConfig(every=3))  # fmt: skip
    records = loop.train(dataclasses.replace(run, sync=sync), devices=jax.devices()[:devices])
    assert events == events_wanted
    assert [r.step for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r.step_time_s > 0 for r in records)
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert saved == [3, 6]
