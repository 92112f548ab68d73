"""Several train steps per XLA execution (TrainConfig.steps_per_execution): the same steps."""

import json

import jax
import numpy as np
import pytest
from test_cli import TINY, t5scale
from test_numerics import BATCH, DATA, MODEL, TX, _relative

from t5scale.data.config import DataConfig
from t5scale.data.synthetic import synthetic_batch
from t5scale.parallel.mesh import ParallelConfig, make_mesh
from t5scale.train.config import CheckpointConfig, RunConfig, TrainConfig
from t5scale.train.loop import StepPrograms
from t5scale.train.state import abstract_state, create_state, plan_for, state_shardings
from t5scale.train.step import batch_sharding, make_train_step, stack_batches

K = 4


def _train(parallel: ParallelConfig, devices, steps_per_execution: int):
    mesh = make_mesh(parallel, devices)
    plan = plan_for(MODEL, parallel.zero_stage, mesh)
    shardings = state_shardings(plan, TX, abstract_state(MODEL, TX))
    step = make_train_step(MODEL, plan, TX, shardings, steps_per_execution=steps_per_execution)
    batches = [
        jax.device_put(synthetic_batch(DATA, BATCH, MODEL.vocab_size, 0, i), batch_sharding(plan))
        for i in range(K)
    ]
    state = create_state(MODEL, TX, plan, seed=0)
    if steps_per_execution == 1:
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    else:
        state, metrics = step(state, stack_batches(batches, plan))
        losses = [float(x) for x in metrics["loss"]]
    return np.array(losses), jax.device_get(state.params)


@pytest.mark.parametrize(
    "parallel, devices",
    [
        (ParallelConfig(), 1),
        # ZeRO-3's gathers and reduce-scatters inside the loop over steps, with tensor sharding
        (ParallelConfig(zero_stage=3, zero=4, tensor=2), 8),
    ],
    ids=["1-device", "stage3-4x2"],
)
def test_k_steps_in_one_execution_are_k_single_steps(parallel, devices):
    one_losses, one_params = _train(parallel, jax.devices()[:devices], 1)
    k_losses, k_params = _train(parallel, jax.devices()[:devices], K)
    assert len(k_losses) == K
    np.testing.assert_allclose(k_losses, one_losses, rtol=1e-5)
    worst = max(jax.tree.leaves(jax.tree.map(_relative, k_params, one_params)))
    assert worst <= 1e-5


def _chunks(steps: int, every: int, validate: int = 0, done: int = 0) -> list[int]:
    run = RunConfig(
        train=TrainConfig(steps=steps, steps_per_execution=K),
        checkpoint=CheckpointConfig(every=every),
        data=DataConfig(validation_every=validate),
    )
    programs = StepPrograms(run, plan=None, one=None)
    programs.many = "the k-step program"  # chunk() only asks whether there is one
    sizes = []
    while done < steps:
        sizes.append(programs.chunk(done))
        done += sizes[-1]
    return sizes


def test_an_execution_never_runs_past_a_checkpoint_a_validation_or_the_end():
    assert _chunks(steps=10, every=5) == [4, 1, 4, 1]
    assert _chunks(steps=8, every=0) == [4, 4]
    assert _chunks(steps=6, every=0) == [4, 1, 1]
    assert _chunks(steps=12, every=0, validate=6) == [4, 1, 1, 4, 1, 1]
    assert _chunks(steps=12, every=4, done=3) == [1, 4, 4]  # resumed off the grid


def test_cli_run_in_executions_of_4_logs_and_saves_every_step_as_a_plain_run(tmp_path):
    records = {}
    for k in (1, K):
        model_dir = tmp_path / f"k{k}"
        done = t5scale(
            "train", *TINY, "--gin.TRAIN_STEPS=6", "--gin.CHECKPOINT_EVERY=5",
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
