"""Bad input to the run side is one line on stderr and exit code 2: checked on the config objects
where they can be (fast), through the CLI in this process where the check is the CLI's, and in
a child process only where the exit path itself is the point."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO, cli_in_process, cli_inline, process_env

from t5scale.data.config import DataConfig
from t5scale.errors import ConfigError, DataError
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.config import CheckpointConfig, TrainConfig
from t5scale.train.optim import OptimizerConfig
from t5scale.train.precision import PrecisionConfig
from t5scale.train.replicas import ReplicaSyncConfig


def _one_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("t5scale: error:"), err
    return lines[0]


# ---- field types: gin's 1.5, True and bare words ------------------------------------------


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: TrainConfig(steps=1.5), "TrainConfig.steps must be an integer, got 1.5"),
        (lambda: TrainConfig(steps=True), "TrainConfig.steps must be an integer, got True"),
        (lambda: TrainConfig(tensorboard="no"), "TrainConfig.tensorboard must be True or False"),
        (lambda: TrainConfig(z_loss="x"), "TrainConfig.z_loss must be a number, got 'x'"),
        (lambda: TrainConfig(model_dir=123), "TrainConfig.model_dir must be a string or None"),
        (lambda: TrainConfig(profile_steps=5), "TrainConfig.profile_steps must be a list"),
        (lambda: ParallelConfig(zero_stage=True), "ParallelConfig.zero_stage must be an integer"),
        (lambda: ParallelConfig(zero=8.0), "ParallelConfig.zero must be an integer, got 8.0"),
        (lambda: ParallelConfig(zero_across_hosts="yes"), "zero_across_hosts must be True or"),
        (lambda: DataConfig(languages="en"), "DataConfig.languages must be a list of strings"),
        (lambda: DataConfig(prefetch=2.5), "DataConfig.prefetch must be an integer"),
        (lambda: DataConfig(corpus_dir=5), "DataConfig.corpus_dir must be a string"),
        (lambda: ModelConfig(layer_norm_epsilon="tiny"), "layer_norm_epsilon must be a number"),
        (
            lambda: ModelConfig(remat="some"),
            "ModelConfig.remat must be dots, minimal, full or auto, got 'some'",
        ),
        (  # the policy's earlier name, which read as "no remat"
            lambda: ModelConfig(remat="none"),
            "ModelConfig.remat 'none' is now 'dots' (it keeps the matmuls' outputs and "
            "recomputes the elementwise work); 'full' and 'minimal' recompute more",
        ),
        (lambda: OptimizerConfig(learning_rate="fast"), "learning_rate must be a number"),
        (lambda: OptimizerConfig(warmup_steps=1.5), "warmup_steps must be an integer"),
        (lambda: CheckpointConfig(every=0.5), "CheckpointConfig.every must be an integer"),
        (lambda: CheckpointConfig(async_save="maybe"), "async_save must be True or False"),
        (lambda: PrecisionConfig(mode=1), "PrecisionConfig.mode must be a string"),
        (lambda: ReplicaSyncConfig(every=1.5), "ReplicaSyncConfig.every must be an integer"),
    ],
)
def test_a_field_of_the_wrong_type_is_named_with_its_value(make, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        make()


def test_lists_stand_for_tuples_and_ints_for_floats():
    """What gin writes for the shipped files must pass."""
    assert TrainConfig(steps=5, profile_steps=[1, 2], model_dir="/m").profile_steps == (1, 2)
    assert DataConfig(languages=["en"]).languages == ("en",)
    assert OptimizerConfig(learning_rate=1, grad_clip_norm=None).learning_rate == 1


# ---- ranges ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: ModelConfig(relative_attention_num_buckets=0), "num_buckets must be >= 2, got 0"),
        (lambda: ModelConfig(relative_attention_num_buckets=-4), "num_buckets must be >= 2"),
        (lambda: ModelConfig(relative_attention_max_distance=0), "max_distance must be > num_"),
        (lambda: ModelConfig(relative_attention_max_distance=16), "max_distance must be > num_"),
        (lambda: ModelConfig(layer_norm_epsilon=-1), "layer_norm_epsilon must be > 0, got -1"),
        (lambda: DataConfig(max_segments=0), "DataConfig.max_segments must be >= 1, got 0"),
        (lambda: DataConfig(corpus_shuffle_buffer=-1), "corpus_shuffle_buffer must be >= 1"),
        (lambda: DataConfig(max_line_bytes=0), "DataConfig.max_line_bytes must be >= 1"),
        (lambda: DataConfig(extra_ids=-1), "DataConfig.extra_ids must be >= 0, got -1"),
        (lambda: DataConfig(validation_batches=0), "DataConfig.validation_batches must be >= 1"),
        (lambda: OptimizerConfig(learning_rate=0), "learning_rate must be > 0, got 0"),
        (lambda: OptimizerConfig(learning_rate=-1e-3), "learning_rate must be > 0"),
        (lambda: OptimizerConfig(weight_decay=-0.1), "weight_decay must be >= 0, got -0.1"),
        (lambda: OptimizerConfig(b1=1.5), "OptimizerConfig.b1 must be in [0, 1), got 1.5"),
        (lambda: OptimizerConfig(b2=1), "OptimizerConfig.b2 must be in [0, 1), got 1"),
        (lambda: OptimizerConfig(eps=0), "OptimizerConfig.eps must be > 0, got 0"),
        (lambda: OptimizerConfig(grad_clip_norm=0), "grad_clip_norm must be None or > 0"),
        (lambda: OptimizerConfig(grad_clip_norm=-1), "grad_clip_norm must be None or > 0"),
        (lambda: TrainConfig(z_loss=-1), "TrainConfig.z_loss must be >= 0, got -1"),
        (lambda: TrainConfig(seed=-1), "TrainConfig.seed must be >= 0, got -1"),
        (lambda: TrainConfig(log_every=0), "TrainConfig.log_every must be >= 1, got 0"),
        (lambda: TrainConfig(steps=1, profile_steps=(2, 3), model_dir="/m"), "<= steps (1)"),
    ],
)
def test_a_value_out_of_range_is_named_with_its_value(make, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        make()


# ---- through the CLI, in this process -------------------------------------------------------

TINY = ["--gin_file=gin/models/mt5_tiny.gin", "--gin.DATA_SOURCE=synthetic",
        "--gin.TRAIN_STEPS=1", "--gin.BATCH_SIZE=8", "--gin.INPUT_LENGTH=32",
        "--gin.TARGET_LENGTH=8"]  # fmt: skip


FP8 = ["--gin_file=gin/models/mt5_tiny.gin", "--gin_file=gin/precision/fp8.gin"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["params", "--gin.TrainConfig.steps=%NOPE"], "gin: macro NOPE is not defined"),
        (["params", "--gin.TRAIN_STEPS=1.5"], "TrainConfig.steps must be an integer, got 1.5"),
        (["params", "--gin.DataConfig.languages=en"], "DataConfig.languages must be a list"),
        (
            ["params", "--gin_file=gin/models/mt5_tiny.gin", "--gin.ModelConfig.remat='none'"],
            "ModelConfig.remat 'none' is now 'dots' (it keeps the matmuls' outputs",
        ),
        (["params", "--num_processes=0"], "DistributedConfig.num_processes must be >= 1"),
        (
            ["params", *FP8, "--gin.ModelConfig.dtype='float32'"],
            "PrecisionConfig.mode='fp8' runs the rest of the model in bf16: set ModelConfig.dtype",
        ),
        (
            ["params", *FP8, "--gin.PrecisionConfig.fp8_amax_history=0"],
            "PrecisionConfig.fp8_amax_history must be >= 1 (the steps each FP8 scale is made from)",
        ),
        (["params", "--num_processes=1", "--process_id=3"], "process_id must be >= 0 and below"),
        (["train", *TINY, "--gin.MODEL_DIR=/proc/t5scale-no/x"], "cannot be used as a directory"),
        # a multi-process run without a coordinator: a DistributedError when it joins
        (["distributed-check", "--num_processes=2", "--process_id=0"], "--coordinator_address"),
        # two cluster files of both kinds: the TPU pod's was dropped without a word before
        (
            [
                "plan",
                *TINY,
                "--gin_file=gin/clusters/h100.gin",
                "--gin_file=gin/clusters/tpu_v5e.gin",
            ],
            "both a GPU cluster (ClusterConfig) and a TPU pod (TpuPodConfig) are given",
        ),
    ],
)
def test_bad_input_through_the_cli_is_one_line(args, says, capsys):
    assert says in _one_line(*cli_in_process(args, capsys)[::2])


def test_a_bare_word_in_a_gin_file_says_what_to_write(tmp_path, capsys):
    """gin said `malformed node or string on line 1: <ast.Name object at 0x…> Failed to parse
    token 'dots'` (2026-11-29)."""
    (tmp_path / "bare.gin").write_text("ModelConfig.d_ff = 256\nModelConfig.remat = dots\n")
    line = _one_line(*cli_in_process(["params", f"--gin_file={tmp_path / 'bare.gin'}"],
                                     capsys)[::2])  # fmt: skip
    assert line == (
        "t5scale: error: gin: dots is not a value (bare.gin, line 2): a string needs quotes "
        "('dots'), a configurable an @ (@dots), a macro a % (%dots)"
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (
            [
                "plan",
                *FP8,
                "--gin_file=gin/clusters/tpu_v5e.gin",
                "--gin.TpuPodConfig.slice='v5e-8'",
            ],
            "PrecisionConfig.mode='fp8' is for Hopper GPUs (FP8 cuBLASLt GEMMs); TPUs run mixed",
        ),
        (
            [
                "train",
                *TINY,
                *FP8,
                "--gin.ReplicaSyncConfig.mode='diloco'",
                "--gin.ParallelConfig.replica=2",
            ],
            "PrecisionConfig.mode='fp8' with local SGD or DiLoCo is not built yet",
        ),  # fmt: skip
    ],
    ids=["tpu", "diloco"],
)
def test_fp8_where_it_is_not_built_is_one_line(args, says, capsys, monkeypatch):
    assert says in _one_line(*cli_inline(args, capsys, monkeypatch)[::2])


def test_a_model_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    file = tmp_path / "run"
    file.write_text("")
    for command in (["train", *TINY], ["convert", f"--hf_dir={tmp_path}"]):
        line = _one_line(*cli_in_process([*command, f"--gin.MODEL_DIR={file}"], capsys)[::2])
        assert f"MODEL_DIR {str(file)!r} is a file, not a directory" in line


def test_train_steps_zero_without_a_model_dir_says_so(capsys):
    code, out, _ = cli_in_process(["train", *TINY, "--gin.TRAIN_STEPS=0"], capsys)
    assert code == 0 and "TrainConfig.steps is 0: nothing to do" in out and "None" not in out


def test_local_sgd_on_a_mesh_of_one_replica_is_refused(capsys):
    args = ["train", *TINY, "--gin.ReplicaSyncConfig.mode='local_sgd'"]
    line = _one_line(*cli_in_process(args, capsys)[::2])
    assert "mode local_sgd needs replica >= 2, the mesh has replica=1" in line


def test_a_vocabulary_that_is_a_directory_says_so_before_tensorflow_starts(tmp_path):
    """Checked where a corpus run begins (loader.register), before it imports TensorFlow."""
    from t5scale.data.loader import register

    config = DataConfig(source="corpus", vocabulary=str(tmp_path))
    with pytest.raises(DataError, match="is a directory, not a SentencePiece model file"):
        register(config, vocab_size=4096)


# ---- convert: a broken Hugging Face directory names the file --------------------------------


@pytest.mark.parametrize(
    "files, says",
    [
        ({"config.json": "[1, 2]"}, "config.json: expected a JSON object, got list"),
        ({"config.json": "{not json"}, "config.json: not valid JSON"),
        ({"model.safetensors": "garbage"}, "model.safetensors: not a safetensors file"),
        ({"model.safetensors.index.json": "{}"}, "index.json: no weight_map"),
    ],
)
def test_a_broken_hf_checkpoint_names_the_file(tmp_path, files, says):
    from t5scale.model.hf_import import params_from_hf

    config = {"model_type": "mt5", "vocab_size": 64, "d_model": 8, "d_ff": 16, "num_heads": 2,
              "d_kv": 4, "num_layers": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=re.escape(says)):
        params_from_hf(tmp_path)


def test_a_convert_that_cannot_read_leaves_no_model_dir(tmp_path, capsys):
    model_dir = tmp_path / "converted"
    args = ["convert", f"--hf_dir={tmp_path / 'nowhere'}", f"--gin.MODEL_DIR='{model_dir}'"]
    code, _, err = cli_in_process(args, capsys)
    assert code == 2 and "config.json" in err and not model_dir.exists()  # (left empty before)


# ---- in a child process: the exit path itself -----------------------------------------------


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["params", "--cpu_devices=0"], {}, "argument --cpu_devices: must be >= 1, got 0"),
        (["params", "--no_such_flag"], {}, "unrecognized arguments: --no_such_flag"),
        # a shard size is read with the flags, before any checkpoint is
        (["export", "--gin.MODEL_DIR=/nowhere", "--out_dir=/tmp/x", "--max_shard_size=12XB"], {},
         "argument --max_shard_size: max_shard_size: expected e.g. 5GB"),
        (["distributed-check"], {"T5SCALE_NUM_PROCESSES": "two", "T5SCALE_COORDINATOR_ADDRESS": "h:1"},
         "t5scale: error: T5SCALE_NUM_PROCESSES must be an integer, got 'two'"),
    ],
)  # fmt: skip
def test_argparse_and_distributed_errors_exit_2_without_a_traceback(args, env, says):
    done = subprocess.run(
        [sys.executable, "-m", "t5scale.cli", *args], cwd=REPO, env=process_env(**env),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert says in _one_line(done.returncode, done.stderr)
