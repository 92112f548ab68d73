"""Local SGD and DiLoCo across `replica` (t5scale/train/replicas.py): the compiled inner step
has no collective over `replica` and the outer step one all-reduce; H = 1 with plain averaging
is synchronous training; DiLoCo's outer step is Nesterov SGD on the replicas' mean change;
checkpoints resume bit for bit mid-period and move between modes where that makes sense."""

import dataclasses
import functools
import json
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import (
    REPO,
    TINY_ARGS,
    TINY_MODEL,
    cli_in_process,
    relative_difference,
    synthetic_batch,
    tiny_run,
)

from t5scale.analysis.hlo import mesh_axes
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.optim import OptimizerConfig
from t5scale.train.replicas import ReplicaSyncConfig
from t5scale.train.setup import Setup, build_setup

BF16 = dataclasses.replace(TINY_MODEL, dtype="bfloat16")


def _setup(stage: int, sync: ReplicaSyncConfig, tensor: int = 1, **changes) -> Setup:
    parallel = ParallelConfig(zero_stage=stage, replica=2, zero=4 // tensor, tensor=tensor)
    return build_setup(dataclasses.replace(tiny_run(parallel, **changes), sync=sync))


EVERY = 2  # inner steps per outer step: H


@functools.cache  # per process: the program test and the periods' test share stage 2's
def _diloco(stage: int, mixed: bool = False, outer_dtype: str = "float32", tensor: int = 1):
    """(setup, compiled step) of DiLoCo every EVERY steps over 2 replicas."""
    sync = ReplicaSyncConfig("diloco", every=EVERY, outer_dtype=outer_dtype)
    setup = _setup(stage, sync, tensor, **({"model": BF16} if mixed else {}))
    return setup, setup.compile()


@pytest.mark.parametrize(
    "stage, mixed, outer_dtype, tensor",
    [
        # CI: stage 2 in fp32, the program whose periods the test below trains; stage 3 in
        # mixed precision with the outer step in bf16, and the other stages, slow
        pytest.param(0, False, "float32", 1, marks=pytest.mark.slow),
        pytest.param(1, False, "float32", 2, marks=pytest.mark.slow),
        (2, False, "float32", 1),
        pytest.param(2, True, "float32", 1, marks=pytest.mark.slow),
        pytest.param(3, True, "bfloat16", 1, marks=pytest.mark.slow),
    ],
)
def test_the_inner_step_never_crosses_replica_and_the_outer_step_all_reduces_once(
    stage, mixed, outer_dtype, tensor
):
    analysis = _diloco(stage, mixed, outer_dtype, tensor)[1].analysis.to_json()
    mesh, sync = analysis["mesh"], analysis["replica_sync"]
    assert analysis["collective_ops"]  # the stage's own collectives, inside each replica
    assert all("replica" not in mesh_axes(op["group"], mesh) for op in analysis["collective_ops"])
    assert sync["inner_step"]["bytes_over_replica"] == 0
    # The outer step: one all-reduce of Δ over `replica` (XLA combines the leaves into one),
    # each device reducing its shard of it: the anchor's, laid out as the optimizer state
    # (whole at stage 0, split over `zero` from stage 1, and over `tensor`).
    over_replica = [
        op for op in sync["outer_collective_ops"] if "replica" in mesh_axes(op["group"], mesh)
    ]
    assert {op["kind"] for op in over_replica} == {"all-reduce"}
    assert sum(op["count"] for op in over_replica) == 1
    assert all(mesh_axes(op["group"], mesh) == {"replica"} for op in over_replica)
    anchor_bytes = sync["outer_state_bytes_per_device"] / 2  # the anchor and its momentum
    width = 4 if outer_dtype == "float32" else 2
    assert sync["outer_step"]["bytes_over_replica"] == anchor_bytes * width / 4
    shards = 1 if stage == 0 else mesh["zero"]
    assert anchor_bytes < analysis["parameters"] * 4 / shards * 1.02  # (tensor splits more)
    # Stages 1-2 gather the new working copy over `zero` after it, as after an update (with
    # tensor parallelism, permuting the vocabulary tables' zero-major rows first).
    others = {op["kind"] for op in sync["outer_collective_ops"] if op not in over_replica}
    assert others - {"collective-permute"} == ({"all-gather"} if stage in (1, 2) else set())
    per_step = sync["per_step"]["bytes_over_replica"]
    assert per_step == sync["outer_step"]["bytes_over_replica"] / EVERY


def _equal_weight_batches(setup: Setup, steps: int) -> list:
    """Synthetic batches in which every target position counts: each replica's slice then holds
    as many target tokens as the others, so the replicas' mean gradient is the global one."""
    run, batches = setup.run, []
    for index in range(steps):
        batch = synthetic_batch(run.data, run.train.batch_size, run.model.vocab_size, 0, index)
        batch.decoder_loss_weights[:] = 1
        batches.append(jax.device_put(batch, setup.batch_sharding()))
    return batches


def _train(setup: Setup, steps: int):
    """(losses, canonical state on the host) after `steps` steps, the outer step where due."""
    step, state, losses = setup.compile(), setup.create_state(seed=0), []
    for done, batch in enumerate(_equal_weight_batches(setup, steps)):
        state, metrics = step.execute(state, batch, done)
        losses.append(float(metrics.loss))
    return np.array(losses), jax.device_get(setup.form.to_canonical(state))


# SGD: with Adam the replicas' averaged updates are not the update of the averaged gradient
# (Adam is not linear in the gradient), so no H gives synchronous training.
SGD = OptimizerConfig(name="sgd", learning_rate=0.5, warmup_steps=2, grad_clip_norm=None)


@pytest.mark.parametrize(
    "stage, sync",
    [
        # CI: DiLoCo's periods and the inner and outer steps' HLO (the tests around this one)
        pytest.param(1, ReplicaSyncConfig("local_sgd", every=1), marks=pytest.mark.slow),
        pytest.param(
            3,
            ReplicaSyncConfig("diloco", every=1, outer_learning_rate=1.0, outer_momentum=0.0),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["stage1-local_sgd", "stage3-diloco-lr1-no-momentum"],
)
def test_one_step_periods_of_plain_averaging_are_synchronous_training(stage, sync):
    want_losses, want = _train(_setup(stage, ReplicaSyncConfig(), optimizer=SGD), 4)
    losses, got = _train(_setup(stage, sync, optimizer=SGD), 4)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert losses[-1] < losses[0] - 0.5  # it learned
    leaves = zip(jax.tree.leaves(got.outer.anchor), jax.tree.leaves(want.params), strict=True)
    assert max(relative_difference(a, b) for a, b in leaves) <= 1e-5
    for replica in range(2):  # every replica restarted from the anchor
        mine = jax.tree.map(lambda x, r=replica: x[r], got.params)
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(got.outer.anchor), strict=True):
            np.testing.assert_array_equal(a, b)


def test_diloco_replicas_diverge_in_a_period_then_take_a_nesterov_step_on_the_mean_change():
    setup, step = _diloco(2)
    step, state = step.compiled, setup.create_state(seed=0)
    start = jax.device_get(setup.form.to_canonical(state))
    batches = _equal_weight_batches(setup, 2)
    for batch in batches:
        state, _ = step(state, batch)
    mid = jax.device_get(setup.form.to_canonical(state))
    state = setup.compiled_outer.compiled(state)
    end = jax.device_get(setup.form.to_canonical(state))
    kernel = ("encoder", "layers", "mlp", "wi_0")

    def leaf(tree):
        return functools.reduce(lambda node, key: node[key], kernel, tree)

    replicas = leaf(mid.params)
    assert not np.allclose(replicas[0], replicas[1])  # each replica its own data and steps
    np.testing.assert_array_equal(leaf(mid.outer.anchor), leaf(start.params)[0])
    # First outer step, optax's Nesterov SGD: trace = Δ, update = −lr (Δ + μ Δ).
    delta = leaf(mid.outer.anchor) - replicas.mean(axis=0)
    expected = leaf(mid.outer.anchor) - 0.7 * (1 + 0.9) * delta
    np.testing.assert_allclose(leaf(end.outer.anchor), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(leaf(end.params)[1], expected, rtol=1e-5, atol=1e-6)
    assert leaf(end.outer.momentum[0].trace) == pytest.approx(delta, rel=1e-5, abs=1e-7)


DILOCO_ARGS = [
    "train", *TINY_ARGS, "--gin_file=gin/zero/stage2.gin", "--gin.BATCH_SIZE=8",
    "--gin.ParallelConfig.replica=2", "--gin.ReplicaSyncConfig.mode='diloco'",
    "--gin.ReplicaSyncConfig.every=3", "--gin.CHECKPOINT_EVERY=2", "--gin.TRAIN_STEPS=9",
]  # fmt: skip
SYNCHRONOUS = "--gin.ReplicaSyncConfig.mode='every_step'"


def _records(model_dir) -> list[dict]:
    return [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]


def _kill_after(model_dir, step: int) -> None:
    """A DiLoCo run in its own process, SIGKILLed once the checkpoint of `step` is complete
    (orbax renames it into place)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "t5scale.cli", *DILOCO_ARGS, f"--gin.MODEL_DIR='{model_dir}'"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (model_dir / "checkpoints" / str(step)).is_dir():
            process.kill()
            process.wait()
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"step {step} never came")


@pytest.mark.slow  # CI: plain runs' kill and resume (test_checkpoint), DiLoCo's period above
def test_killed_mid_period_resumes_exactly_and_checkpoints_move_between_modes(tmp_path, capsys):
    def train(model_dir, *extra):
        return cli_in_process([*DILOCO_ARGS, f"--gin.MODEL_DIR='{model_dir}'", *extra], capsys)

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert train(reference)[0] == 0
    _kill_after(killed, 2)  # checkpoints every 2 steps, periods of 3: the newest is mid-period
    # Mid-period the replicas differ: a synchronous run cannot take them (one line, exit 2).
    code, _, err = train(killed, SYNCHRONOUS)
    assert code == 2, err
    assert "resumes into 2 replicas only, not a synchronous run" in err.strip().splitlines()[-1]
    # DiLoCo resumes: per-replica parameters and inner optimizer states, the anchor, the
    # outer momentum and the data position, bit for bit.
    code, out, _ = train(killed)
    resumed_at = int(out.split("resuming from the checkpoint at step ")[1].split()[0])
    assert code == 0 and resumed_at % 3, resumed_at  # mid-period
    assert "diloco: 2 replicas step on their own and synchronise every 3 steps" in out
    assert [r["loss"] for r in _records(killed)] == [r["loss"] for r in _records(reference)]
    sync = json.loads((reference / "step_analysis.json").read_text())["replica_sync"]
    assert sync["mode"] == "diloco" and sync["every"] == 3

    # At a synchronisation (step 9) a synchronous run resumes from the anchor, and DiLoCo
    # resumes from a synchronous run's checkpoint (step 11).
    code, out, err = train(killed, SYNCHRONOUS, "--gin.TRAIN_STEPS=11")
    assert code == 0 and "resuming from the checkpoint at step 9" in out, err
    code, out, err = train(killed, "--gin.TRAIN_STEPS=12")
    assert code == 0 and "resuming from the checkpoint at step 11" in out, err
    assert np.isfinite([r["loss"] for r in _records(killed)]).all()
