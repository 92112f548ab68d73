"""The `t5scale` command, run as a user runs it: real processes, real files."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_ARGS, cli_in_process, read_scalars, run_cli


def _train_listing_tensorflow(*args: str) -> subprocess.CompletedProcess:
    """`t5scale ARGS` in a process of its own, which then prints the TensorFlow and seqio
    modules it imported."""
    code = (
        "import sys; from t5scale.cli import main; "
        f"code = main({list(args)!r}); "
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'seqio')); "
        "print('tensorflow modules:', leaked); sys.exit(code)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600
    )


def test_train_writes_metrics_tensorboard_profile_config_and_step_analysis(tmp_path):
    model_dir = tmp_path / "run"
    done = _train_listing_tensorflow(
        "train", *TINY_ARGS, "--gin_file=gin/zero/stage2.gin", "--gin.TRAIN_STEPS=4",
        f"--gin.MODEL_DIR={model_dir}", "--gin.TrainConfig.profile_steps=(2, 3)",
        "--gin.DataConfig.validation_every=2", "--gin.DataConfig.validation_batches=1",
        "--gin.ModelConfig.remat='auto'",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "step 4/4" in done.stdout and "ETA" in done.stdout and "tokens/s" in done.stdout
    # Synthetic data import no TensorFlow: not for the data, the validation, the profile, nor the
    # TensorBoard scalars (TensorBoard's file layer loads TensorFlow where it is installed unless
    # told otherwise). It costs a run seconds to start.
    assert "tensorflow modules: []" in done.stdout

    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert record["loss"] > 0 and record["step_time_s"] > 0 and record["tokens_per_s"] > 0
        # the CPU reports no allocator peak and has no datasheet peak: null, not zero
        assert record["memory_peak_bytes"] is None and record["mfu"] is None
        assert record["memory_xla_estimate_bytes"] > 0

    # TensorBoard, read back by TensorBoard's own reader: the same values as metrics.jsonl.
    train = read_scalars(model_dir / "train")
    assert train["loss"] == [(r["step"], pytest.approx(r["loss"])) for r in records]
    for tag in ("learning_rate", "grad_norm", "tokens_per_s", "memory/xla_estimate_bytes"):
        assert [step for step, _ in train[tag]] == [1, 2, 3, 4]
    assert "mfu" not in train and "memory/peak_bytes" not in train  # not known here
    validation = read_scalars(model_dir / "validation")
    assert [step for step, _ in validation["loss"]] == [2, 4]
    assert validation["loss"][0][1] == pytest.approx(records[1]["validation_loss"])

    # The profile: a trace of steps 2 and 3, each an execution of the compiled step.
    (trace,) = (model_dir / "profile").rglob("perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = [e.get("name", "") for e in events if e.get("ph") == "X"]
    assert sum(name.endswith("Execute (jit_step)") for name in names) >= 2  # also per device
    assert names.count("train") == 2  # jax.profiler.StepTraceAnnotation, one per step

    config = (model_dir / "config.gin").read_text()
    assert "ParallelConfig.zero_stage = 2" in config and "TRAIN_STEPS = 4" in config

    analysis = json.loads((model_dir / "step_analysis.json").read_text())
    memory = analysis["memory_per_device"]
    assert {"argument_bytes", "output_bytes", "temp_bytes", "alias_bytes"} <= set(memory)
    assert analysis["flops_per_step"]["model"] > 0
    assert analysis["zero_stage"] == 2 and analysis["mesh"]["zero"] == 8
    assert analysis["collectives"]["reduce-scatter"]["count"] > 0
    assert analysis["collectives"]["all-gather"]["bytes"] > 0
    # remat 'auto' chose the cheapest policy, within this machine's memory shared by 8 devices
    remat = analysis["remat"]
    assert remat["requested"] == "auto" and remat["policy"] == "dots" and remat["fits"]
    assert remat["tried"][0]["peak_estimate_bytes"] == memory["peak_estimate_bytes"]


def test_params_prints_the_count_without_allocating():
    done = run_cli("params", "--gin_file=gin/models/mt5_xxl.gin", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["parameters"] == 12_921_057_280
    assert sum(report["breakdown"].values()) == report["parameters"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gin.NoSuchThing.value=1"], "No configurable matching 'NoSuchThing'"),
        (["--gin_file=gin/models/no_such_model.gin"], "gin file not found"),
        (["--gin.ModelConfig.no_such_field=1"], "doesn't have a parameter named"),
        (["--gin.ParallelConfig.zero_stage=4"], "ZeRO stage must be 0, 1, 2 or 3"),
        (["--gin.ParallelConfig.tensor=3"], "does not divide 8 devices"),
        (["--gin.ParallelConfig.zero=3"], "needs 3 devices, but 8 are there"),
        (
            ["--gin.ModelConfig.num_heads=6", "--gin.ParallelConfig.tensor=4"],
            "does not divide the 'heads' dimension",
        ),  # fmt: skip
        # XLA's SPMD partitioner cannot compile the step without a data-parallel axis
        (["--gin.ParallelConfig.tensor=8"], "tensor=8 over all 8 devices leaves no data-parallel"),
        (["--gin.BATCH_SIZE=12"], "not divisible by data-parallel size 8"),
        (["--gin.MICRO_BATCHES=3"], "micro_batches 3"),
        (["--gin.STEPS_PER_EXECUTION=0"], "steps_per_execution must be >= 1"),
        (["--gin.TrainConfig.profile_steps=(3, 2)"], "profile_steps must be (first, last)"),
        (["--gin.TrainConfig.profile_steps=(1, 1)"], "profile_steps writes into MODEL_DIR"),
        (["--gin.PrecisionConfig.mode='half'"], "PrecisionConfig.mode must be one of"),
        (["--gin.PrecisionConfig.mode='mixed'"], "set ModelConfig.dtype='bfloat16'"),
        (["--gin.ModelConfig.name='mt5_xlarge'"], "'mt5_xlarge' is not a known size"),
        # gin would take it as a new macro and train the default 20 steps
        (
            ["--gin.TRAIN_STEP=100"],
            "macro TRAIN_STEP is bound but no configuration reads it; did you mean TRAIN_STEPS?",
        ),  # fmt: skip
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, message, capsys):
    """In this process (cli.main as the console script calls it); the exit code a process of
    its own returns is the next test's."""
    code, out, err = cli_in_process(["train", *TINY_ARGS, "--gin.TRAIN_STEPS=1", *args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("t5scale: error:"), err
    assert message in lines[0]
    assert "Traceback" not in err + out


def test_bad_input_in_a_process_of_its_own_exits_2_with_one_line():
    done = run_cli("train", *TINY_ARGS, "--gin.TRAIN_STEPS=1", "--gin.ParallelConfig.tensor=3")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("t5scale: error:") and "does not divide 8 devices" in line


# The console script's start as a plain install has it (no CUDA plugin: with it, t5scale
# imports jax at once to start it quietly, t5scale/startup.py).
WITHOUT_PLUGIN = """
import sys
sys.modules["jax_cuda12_plugin"] = None
from t5scale.cli import main
try:
    sys.exit(main(sys.argv[1:]))  # argparse exits by itself on --help and on a bad flag
finally:
    heavy = {"jax", "flax", "optax", "orbax", "tensorflow", "numpy"} & set(sys.modules)
    print("imported:" + ",".join(sorted(heavy)), file=sys.stderr)
"""


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["train", "--no_such_flag"], 2)])
def test_help_and_a_bad_flag_import_no_jax(args, code):
    """`t5scale --help` and argparse's errors answer before any command imports its modules."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_PLUGIN, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == code, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "imported:"
    assert "train" in done.stdout if code == 0 else "t5scale: error:" in done.stderr


def test_an_xla_abort_in_plan_is_one_line_and_exit_code_5():
    """plan and simulate compile in a child process: when XLA aborts there (a failed C++ check
    kills the process with SIGABRT), the user gets one line, not a stack dump. Here the abort is
    the real signal, sent to the child while it compiles."""
    parent = subprocess.Popen(
        [sys.executable, "-m", "t5scale.cli", "plan", "--gin_file=gin/models/mt5_small.gin",
         "--gin.DEVICES=8", "--gin.INPUT_LENGTH=64", "--gin.TARGET_LENGTH=16"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    children = []
    while not children and time.monotonic() < deadline:
        time.sleep(0.5)
        found = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
        children = [int(pid) for pid in found.read_text().split()] if found.exists() else []
    assert children, "plan started no child"
    time.sleep(3)  # into its imports or its compile
    os.kill(children[0], signal.SIGABRT)
    out, err = parent.communicate(timeout=60)
    assert parent.returncode == 5, (out, err)
    lines = err.strip().splitlines()
    assert lines[-1].startswith("t5scale: error: the XLA compiler aborted (SIGABRT)"), err
    assert "Traceback" not in err


def test_a_macro_no_configuration_reads_in_a_gin_file_is_an_error(tmp_path):
    from t5scale.config import parse_gin
    from t5scale.errors import ConfigError

    mine = tmp_path / "mine.gin"
    mine.write_text("include 'gin/models/mt5_tiny.gin'\nBATCH_SIZ = 16\nTRAIN_STEPS = 5\n")
    with pytest.raises(ConfigError, match="macro BATCH_SIZ is bound .* did you mean BATCH_SIZE"):
        parse_gin([str(mine)], [])
    mine.write_text("MY_STEPS = 5\nTRAIN_STEPS = %MY_STEPS\n")  # a macro read by a macro
    parse_gin([str(mine)], [])
    # a shipped macro left unread by binding its parameter directly is no mistake
    parse_gin(["gin/study/quick.gin"], ["StudyConfig.study_dir='/tmp/elsewhere'"])
