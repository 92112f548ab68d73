"""The records training writes: metrics.jsonl's lines (StepRecord) and a checkpoint's meta
(CheckpointMeta, which holds the run), and checkpoints whose meta predates the run in it."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import TINY_ARGS, cli_in_process, run_cli

from t5scale.config import gin_text_of, run_from_gin_text
from t5scale.errors import ConfigError
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.checkpoint import Checkpoints
from t5scale.train.checkpoint_meta import CheckpointMeta, SavedSync, model_signature
from t5scale.train.config import CheckpointConfig, RunConfig, TrainConfig
from t5scale.train.export import export_checkpoint
from t5scale.train.metrics import StepRecord
from t5scale.train.replicas import ReplicaSyncConfig

# metrics.jsonl's keys, in order, as the loop wrote them before its records were typed: the step,
# the step's metrics sorted by name (jax returned them from a dict), then the loop's own.
METRICS_KEYS = [
    "step", "cross_entropy", "grad_norm", "loss", "nonfinite", "target_tokens", "z_loss",
    "learning_rate", "step_time_s", "tokens_per_s", "mfu", "memory_peak_bytes",
    "memory_xla_estimate_bytes", "skipped_steps",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """MODEL_DIR of a real 3-step run: validation and checkpoints at steps 2 and 3. (test_cli.py's
    run's settings: the session's compilation cache serves the second of the two.)"""
    model_dir = tmp_path_factory.mktemp("records") / "run"
    done = run_cli(
        "train", *TINY_ARGS, "--gin_file=gin/zero/stage2.gin", "--gin.ModelConfig.remat='auto'",
        "--gin.TRAIN_STEPS=3", "--gin.CHECKPOINT_EVERY=2",
        "--gin.DataConfig.validation_every=2", "--gin.DataConfig.validation_batches=1",
        f"--gin.MODEL_DIR={model_dir}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return model_dir


def test_metrics_jsonl_lines_are_step_records_byte_for_byte(trained):
    lines = (trained / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    for line in lines:
        record = StepRecord.from_json(json.loads(line))
        assert json.dumps(record.to_json()) == line
    keys = [list(json.loads(line)) for line in lines]
    validated = [*METRICS_KEYS, "validation_loss"]  # every 2 steps and at the last
    assert keys == [METRICS_KEYS, validated, validated]
    first = json.loads(lines[0])
    assert type(first["step"]) is int and type(first["skipped_steps"]) is int
    floats = ("cross_entropy", "grad_norm", "loss", "nonfinite", "target_tokens", "z_loss",
              "learning_rate", "step_time_s", "tokens_per_s")  # fmt: skip
    assert all(type(first[name]) is float for name in floats)
    assert first["mfu"] is None and first["memory_peak_bytes"] is None  # not known on the CPU
    assert type(first["memory_xla_estimate_bytes"]) is int


def test_a_checkpoint_s_meta_holds_the_run(trained):
    checkpoints = Checkpoints(str(trained), CheckpointConfig(), read_only=True)
    try:
        meta = checkpoints.meta(3)
    finally:
        checkpoints.close()
    assert (meta.step, meta.data_position, meta.optimizer, meta.gin) == (3, 3, "adamw", None)
    assert meta.run == run_from_gin_text((trained / "config.gin").read_text())
    assert meta.model == model_signature(meta.run.model)
    assert meta.sync == SavedSync(mode="every_step", replicas=1)


def test_checkpoint_meta_round_trips_through_json():
    run = RunConfig(
        model=ModelConfig(name="mt5_small", dtype="bfloat16"),
        parallel=ParallelConfig(zero_stage=2, replica=2),
        train=TrainConfig(steps=7, seed=3, profile_steps=(2, 3), model_dir="/tmp/run"),
        sync=ReplicaSyncConfig(mode="diloco", every=3),
    )
    meta = CheckpointMeta(
        step=6, data_position=6, seed=3, model=model_signature(run.model), optimizer="adamw",
        precision="mixed", sync=SavedSync.of(run.sync, replicas=2), run=run,
    )  # fmt: skip
    data = json.loads(json.dumps(meta.to_json()))
    assert "gin" not in data and data["sync"]["every"] == 3
    assert CheckpointMeta.from_json(data) == meta
    # written before remat 'none' was named 'dots' (the same policy); as input it is refused
    assert data["run"]["model"]["remat"] == "dots"
    data["run"]["model"]["remat"] = "none"
    assert CheckpointMeta.from_json(data) == meta


def test_an_operative_gin_config_from_before_dots_reads_as_dots():
    """The metas of checkpoints from before the run was kept hold gin text that binds every
    ModelConfig field, remat 'none' included when it was the default."""
    model = ModelConfig(name="mt5_small", dtype="bfloat16")
    old = gin_text_of(model).replace("ModelConfig.remat = 'dots'", "ModelConfig.remat = 'none'")
    assert "'none'" in old
    assert run_from_gin_text(old).model == model


# The metas of checkpoints written before CheckpointMeta: the training loop's (a DiLoCo run),
# `t5scale convert`'s, and a hand-made one (tests, bench/bench_checkpoint.py).
SIGNATURE = model_signature(ModelConfig())
OLD_LOOP_META = {
    "step": 4, "data_position": 4, "seed": 0, "model": SIGNATURE, "optimizer": "adamw",
    "precision": "float32",
    "sync": {"mode": "diloco", "every": 2, "outer_learning_rate": 0.7, "outer_momentum": 0.9,
             "replicas": 2},
    "gin": "TRAIN_STEPS = 4\n",
}  # fmt: skip
OLD_CONVERTED_META = {
    "step": 0, "data_position": 0, "seed": 0, "model": SIGNATURE, "optimizer": "adamw",
    "gin": "ModelConfig.dtype = 'float32'\n",
}  # fmt: skip
OLD_HAND_MADE_META = {"step": 3, "data_position": 3, "optimizer": "adamw", "model": SIGNATURE}


def test_old_metas_read_with_their_fields():
    loop = CheckpointMeta.from_json(OLD_LOOP_META)
    assert loop.run is None and loop.gin == "TRAIN_STEPS = 4\n"
    assert (loop.step, loop.data_position, loop.precision) == (4, 4, "float32")
    assert loop.model == SIGNATURE
    assert (loop.sync.mode, loop.sync.replicas_apart, loop.sync.period) == ("diloco", 2, 2)
    assert loop.sync.config() == ReplicaSyncConfig(mode="diloco", every=2)
    assert loop.to_json() == OLD_LOOP_META  # the same form, field by field

    converted = CheckpointMeta.from_json(OLD_CONVERTED_META)
    assert converted.sync == SavedSync() and converted.sync.replicas_apart is None
    assert converted.precision is None and converted.gin.startswith("ModelConfig")

    hand_made = CheckpointMeta.from_json(OLD_HAND_MADE_META)
    assert (hand_made.seed, hand_made.run, hand_made.gin) == (None, None, None)

    with pytest.raises(ConfigError, match="has a meta this t5scale cannot read"):
        CheckpointMeta.read({"step": 1, "optimizer": "adamw"}, "checkpoint x/1")  # no model


def _as_written_before_the_run_was_kept(model_dir: Path) -> None:
    """Each checkpoint's meta as the loop wrote it before: the operative gin config as text in
    place of the run."""
    gin = (model_dir / "config.gin").read_text()
    for path in (model_dir / "checkpoints").glob("*/meta/metadata"):
        meta = json.loads(path.read_text())
        del meta["run"]
        path.write_text(json.dumps(meta | {"gin": gin}))


@pytest.mark.slow  # CI: old metas and gin files read as they were written (above)
def test_an_old_checkpoint_exports_through_gin_and_resumes(trained, tmp_path, capsys):
    model_dir = tmp_path / "old"
    shutil.copytree(trained, model_dir)
    _as_written_before_the_run_was_kept(model_dir)

    with pytest.raises(ConfigError, match="written before checkpoints kept their run"):
        export_checkpoint(str(model_dir), str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()

    # Read through the run its gin describes (as `t5scale export` does): the same files as the
    # checkpoint with the run in its meta gives.
    old = export_checkpoint(str(model_dir), str(tmp_path / "old_out"), run_of_gin=run_from_gin_text)
    new = export_checkpoint(str(trained), str(tmp_path / "new_out"))
    assert old.step == new.step == 3 and old.run == new.run
    for path in new.files:
        assert (tmp_path / "old_out" / path.name).read_bytes() == path.read_bytes(), path.name
    saved = ocp.StandardCheckpointer().restore(model_dir / "checkpoints" / "3" / "state")
    assert old.parameters == sum(np.size(x) for x in jax.tree.leaves(saved["params"]))

    code, out, err = cli_in_process(
        ["train", *TINY_ARGS, "--gin.TRAIN_STEPS=4", f"--gin.MODEL_DIR={model_dir}"], capsys
    )
    assert code == 0, err
    assert "resuming from the checkpoint at step 3" in out
