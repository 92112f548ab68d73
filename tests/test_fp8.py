"""FP8 matmuls (gin/precision/fp8.gin; t5scale/train/fp8.py) on the CPU, where XLA emulates the
float8 types: the FP8 state follows delayed scaling's rule and never the optimizer, is the same
on one device and on 8 with micro-batches (the max over both), trains as mixed precision does,
and is checkpointed as an item of its own that a resumed run takes up exactly and that moves
between fp8 and mixed precision (resumed bit for bit after a kill: tests/test_checkpoint.py).

The program for an H100, where every layer GEMM is an FP8 one, is tests/test_xla_gpu.py's."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import TINY_ARGS, TINY_MODEL, cli_in_process, run_steps, tiny_setup

from t5scale.model.hf_import import params_from_hf
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.checkpoint import Checkpoints, saved_meta
from t5scale.train.config import CheckpointConfig
from t5scale.train.precision import PrecisionConfig

BF16_MODEL = TINY_MODEL.__class__(vocab_size=TINY_MODEL.vocab_size, dtype="bfloat16")
HISTORY = 4  # longer than the steps below: the oldest entries stay 0
STEPS = 3
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@functools.cache
def _compiled(precision: str, devices: int, stage: int, micro_batches: int, tensor: int = 1,
              pipeline: int = 1):  # fmt: skip
    """(setup, compiled step) of the shared small run: the tests below share each program."""
    zero = devices // (tensor * pipeline)
    parallel = ParallelConfig(zero_stage=stage, zero=zero, tensor=tensor, pipeline=pipeline)
    setup = tiny_setup(
        parallel, devices, model=BF16_MODEL,
        precision=PrecisionConfig(mode=precision, fp8_amax_history=HISTORY),
        micro_batches=micro_batches,
    )  # fmt: skip
    return setup, setup.compile().compiled


@functools.cache
def _train(*layout, **more):
    """(losses, FP8 state on the host or None) after STEPS steps of `_compiled(*layout)`."""
    setup, step = _compiled(*layout, **more)
    state, losses = run_steps(setup, setup.create_state(seed=0), 0, STEPS - 1, step)
    return losses, jax.device_get(state.fp8)


def _matmuls(fp8) -> dict[str, dict[str, np.ndarray]]:
    """Each FP8 matmul's state by its path (encoder/layers/attention/query_fp8, ...)."""
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(fp8)[0]:
        keys = [str(key.key) for key in path]
        found.setdefault("/".join(keys[:-1]), {})[keys[-1]] = leaf
    return found


def test_the_fp8_state_follows_delayed_scaling_and_never_the_optimizer():
    """After each step a history holds that step's amax at its front (flax keeps it as a ring:
    the older ones rotate behind it), and each scale is the one made from the history before the
    step: its largest amax / the format's largest value.
    Had AdamW (with weight decay and clipping) stepped them, neither would hold. 6 matmuls an
    encoder layer and 10 a decoder layer have one each."""
    _, fp8 = _train("fp8", 1, 0, 1)
    matmuls = _matmuls(fp8)
    layers = BF16_MODEL.num_encoder_layers
    assert sum(name.startswith("encoder") for name in matmuls) == 6
    assert sum(name.startswith("decoder") for name in matmuls) == 10
    for name, state in matmuls.items():
        for operand, largest in (("input", E4M3_MAX), ("kernel", E4M3_MAX),
                                 ("output_grad", E5M2_MAX)):  # fmt: skip
            history = state[f"{operand}_amax_history"]
            assert history.shape == (layers, HISTORY)
            assert np.all(history[:, 0] > 0) and np.all((history > 0).sum(axis=1) == STEPS), name
            before_last_step = history[:, 1:].max(axis=1)
            np.testing.assert_allclose(
                state[f"{operand}_scale"][:, 0], before_last_step / largest, rtol=1e-6
            )


def test_the_next_fp8_state_is_the_max_over_the_data_parallel_devices():
    """What each device found (a different history on each of 4) becomes, on every device, the
    largest of them: one pmax of one flat buffer."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from t5scale.train import fp8

    mesh = Mesh(np.array(jax.devices()[:4]), ("zero",))
    found = {"a": {"scale": np.arange(4.0).reshape(4, 1), "amax_history": -np.eye(4) + 1.0}}
    found["a"]["amax_history"][2, 3] = 7.0  # device 2 saw the largest amax of slot 3
    reduced = jax.shard_map(
        lambda tree: fp8.max_over_devices(jax.tree.map(lambda x: x[0], tree), ("zero",), after=()),
        mesh=mesh, in_specs=P("zero"), out_specs=P(),
    )(found)  # fmt: skip
    np.testing.assert_array_equal(reduced["a"]["scale"], [3.0])
    np.testing.assert_array_equal(reduced["a"]["amax_history"], [1.0, 1.0, 1.0, 7.0])


def _assert_the_state_of_one_device(fp8) -> None:
    """`fp8` after STEPS steps of a run over several devices is what one device records of the
    whole batch. The first step's kernel amaxes agree exactly: the same parameters, however
    split (XLA takes the amax of an operand split over `tensor` over the whole). Its input
    amaxes agree to 5% (matmuls blocked for other shapes round differently in bf16, and a value
    that crosses an e4m3 step on its way moves by 6-12%); the rest to 25%: the gradients pass
    through e5m2 (2 bits of mantissa), and the later steps start from the parameters those
    gradients made. The reductions themselves are exact (the test above)."""
    _, one = _train("fp8", 1, 0, 1)
    first_step = (1 - STEPS) % HISTORY  # where the ring keeps the first step's amax
    for name, state in _matmuls(one).items():
        for leaf, value in _matmuls(fp8)[name].items():
            where = f"{name}/{leaf}"
            np.testing.assert_allclose(value, state[leaf], rtol=0.25, err_msg=where)
            if leaf in ("input_amax_history", "kernel_amax_history"):
                got, want = value[:, first_step], state[leaf][:, first_step]
                exact = leaf == "kernel_amax_history"
                np.testing.assert_allclose(got, want, rtol=0 if exact else 0.05, err_msg=where)


@pytest.mark.slow  # CI: the reduction over devices, exact (above)
def test_the_fp8_state_of_zero_3_tensor_parallel_and_micro_batches_is_that_of_one_device():
    """ZeRO-3 over 2 devices × tensor 2, with 2 micro-batches: the max over devices and
    micro-batches."""
    _assert_the_state_of_one_device(_train("fp8", 4, 3, 2, tensor=2)[1])


@pytest.mark.slow  # with ZeRO-3 × tensor × micro-batches (above), under -m slow
def test_the_fp8_state_of_a_pipeline_is_that_of_one_device():
    """2 pipeline stages × ZeRO-1 over 2 devices, 2 micro-batches: each stage keeps its own
    layers' state, the max over the schedule's ticks (a tick's copy each)."""
    _assert_the_state_of_one_device(_train("fp8", 4, 1, 2, pipeline=2)[1])


def test_fp8_trains_as_mixed_precision_does():
    fp8, _ = _train("fp8", 1, 0, 1)
    mixed, none = _train("mixed", 1, 0, 1)
    assert none is None
    assert fp8[0] == pytest.approx(mixed[0], rel=1e-2)
    assert fp8[-1] < fp8[0]
    np.testing.assert_allclose(fp8, mixed, rtol=2e-2)


def test_an_fp8_checkpoint_goes_on_exactly_as_the_run_that_never_stopped(tmp_path):
    """The FP8 state saved as the checkpoint's `fp8` item and restored with the rest: the next
    steps' losses and FP8 state are those of the run that never stopped, bit for bit. (In this
    process; a killed fp8 run's processes: test_checkpoint.py, under -m slow.)"""
    setup, step = _compiled("fp8", 1, 0, 1)
    form = setup.form
    state, _ = run_steps(setup, setup.create_state(seed=0), 0, 1, step)
    checkpoints = Checkpoints(str(tmp_path), CheckpointConfig())
    checkpoints.save(2, form.to_canonical(state), saved_meta(setup.run, form, 2, 2))
    checkpoints.wait()
    restored = checkpoints.restore_latest(
        form.restore_target, setup.run.model, setup.run.optimizer.name
    )
    checkpoints.close()
    assert restored.meta.step == 2 and (tmp_path / "checkpoints" / "2" / "fp8").is_dir()
    resumed = form.from_canonical(restored.state, restored.meta)
    went_on, losses = run_steps(setup, state, 2, 3, step)
    again, resumed_losses = run_steps(setup, resumed, 2, 3, step)
    np.testing.assert_array_equal(resumed_losses, losses)
    fp8, want = jax.device_get(again.fp8), jax.device_get(went_on.fp8)
    assert any(np.any(leaf) for leaf in jax.tree.leaves(fp8))
    for a, b in zip(jax.tree.leaves(fp8), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def _train_args(model_dir: Path, precision: str, steps: int) -> list[str]:
    return [
        "train", *TINY_ARGS, "--gin_file=gin/zero/stage2.gin",
        f"--gin_file=gin/precision/{precision}.gin", "--gin.BATCH_SIZE=8",
        f"--gin.PrecisionConfig.fp8_amax_history={HISTORY}", "--gin.CHECKPOINT_EVERY=2",
        f"--gin.TRAIN_STEPS={steps}", f"--gin.MODEL_DIR='{model_dir}'",
    ]  # fmt: skip


def _losses(model_dir: Path) -> dict[int, float]:
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


@pytest.mark.slow  # CI: an fp8 checkpoint goes on exactly (above); export (test_hf_import.py)
def test_fp8_checkpoints_move_to_and_from_mixed_and_export_the_parameters_alone(tmp_path, capsys):
    """The FP8 state is the checkpoint's `fp8` item (tests/test_checkpoint.py resumes it bit for
    bit after a kill): mixed precision resumes the checkpoint without it, fp8 the mixed one with
    fresh scales, each said in one line; `export` writes the parameters alone."""
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    code, out, err = cli_in_process(_train_args(whole, "fp8", 4), capsys)
    assert code == 0, err[-3000:]
    saved = whole / "checkpoints" / "4"
    assert (saved / "fp8").is_dir()
    assert "_fp8" not in json.dumps(json.loads((saved / "state" / "_METADATA").read_text()))

    shutil.copytree(saved, moved / "checkpoints" / "4")
    code, out, err = cli_in_process(_train_args(moved, "mixed", 6), capsys)
    assert code == 0, err[-3000:]
    assert "its FP8 scales and amax histories are left out" in err
    assert not (moved / "checkpoints" / "6" / "fp8").exists()
    code, out, err = cli_in_process(_train_args(moved, "fp8", 8), capsys)
    assert code == 0, err[-3000:]
    assert "it holds no FP8 state; the FP8 scales and amax histories start fresh" in err
    assert sorted(_losses(moved)) == [5, 6, 7, 8]

    exported = tmp_path / "hf"
    code, _, err = cli_in_process(["export", f"--gin.MODEL_DIR='{whole}'", f"--out_dir={exported}"],
                                  capsys)  # fmt: skip
    assert code == 0, err[-3000:]
    _, params = params_from_hf(exported)  # reads every tensor the export wrote, and only them
    state = ocp.StandardCheckpointer().restore(saved / "state")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state["params"]), strict=True):
        np.testing.assert_array_equal(a, b)
