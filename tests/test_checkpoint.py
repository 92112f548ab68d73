"""Checkpoints: exact resume after SIGKILL and SIGTERM (real processes; FP8 state too),
restore onto other stages and meshes, damaged checkpoints, a checkpoint of another model, NaN and
Inf."""

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import REPO, TINY_ARGS, TINY_MODEL, cli_in_process, run_cli, run_steps, tiny_setup
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.checkpoint import CheckpointMeta, Checkpoints, model_signature
from t5scale.train.config import CheckpointConfig, model_dir_lock


def _read_metrics(model_dir: Path) -> list[dict]:
    path = model_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _saved_params(model_dir: Path, step: int) -> list[np.ndarray]:
    restored = ocp.StandardCheckpointer().restore(model_dir / "checkpoints" / str(step) / "state")
    return [np.asarray(x) for x in jax.tree.leaves(restored["params"])]


def _saved_fp8(model_dir: Path, step: int) -> list[np.ndarray]:
    restored = ocp.StandardCheckpointer().restore(model_dir / "checkpoints" / str(step) / "fp8")
    return [np.asarray(x) for x in jax.tree.leaves(restored)]


# ZeRO-3 over 2 CPU devices, a checkpoint every 2 steps; in fp32, or with FP8 matmuls, whose
# scales and amax histories are state of their own that a resumed run must take up exactly. The
# data resume at the checkpoint's position: synthetic batches (skipped to it), or the shipped
# corpus (one language and a short shuffle buffer keep its start-up short; TensorFlow's import
# and the pipeline's start still cost each process some 15 s here).
RESUME_ARGS = [
    "train", "--cpu_devices=2",
    "--gin_file=gin/models/mt5_tiny.gin", "--gin_file=gin/zero/stage3.gin",
    "--gin.DataConfig.languages=('en',)", "--gin.DataConfig.corpus_shuffle_buffer=16",
    "--gin.INPUT_LENGTH=64", "--gin.TARGET_LENGTH=16", "--gin.BATCH_SIZE=4",
    "--gin.TRAIN_STEPS=12", "--gin.CHECKPOINT_EVERY=2",
]  # fmt: skip


def _start(model_dir: Path, precision: str, data: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "t5scale.cli", *RESUME_ARGS,
               f"--gin_file=gin/precision/{precision}.gin", f"--gin.DATA_SOURCE='{data}'",
               f"--gin.MODEL_DIR='{model_dir}'"]  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_step(process: subprocess.Popen, model_dir: Path, step: int) -> int:
    """Wait until metrics.jsonl shows `step`; return the last step logged by then."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        logged = _read_metrics(model_dir)
        if logged and logged[-1]["step"] >= step:
            return logged[-1]["step"]
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"step {step} never came")


def _signal_after(process: subprocess.Popen, model_dir: Path, step: int, signum: int) -> int:
    """Send `signum` once metrics.jsonl shows `step`; return the last step logged by then."""
    logged = _wait_for_step(process, model_dir, step)
    process.send_signal(signum)
    return logged


# CI: fp32 on synthetic data; the corpus resumes at a position in test_data.py, an fp8
# checkpoint exactly in one process in test_fp8.py. On the corpus, and in fp8 (a longer compile
# in each of the four processes), under -m slow.
@pytest.mark.parametrize(
    "precision, data",
    [
        ("fp32", "synthetic"),
        pytest.param("fp32", "corpus", marks=pytest.mark.slow),
        pytest.param("fp8", "corpus", marks=pytest.mark.slow),
    ],
)
def test_killed_and_preempted_runs_end_exactly_like_an_uninterrupted_one(tmp_path, precision, data):
    run_dir = tmp_path / "interrupted"
    events, reference = [], None
    for step, signum in [(3, signal.SIGKILL), (5, signal.SIGINT), (8, signal.SIGTERM)]:
        process = _start(run_dir, precision, data)
        if reference is None:  # beside the chain, once its program is in the compilation cache
            _wait_for_step(process, run_dir, 1)
            reference = _start(tmp_path / "reference", precision, data)
        sent_at = _signal_after(process, run_dir, step, signum)
        out, err = process.communicate(timeout=120)
        events.append((signum.name, sent_at, process.returncode))
        if signum == signal.SIGTERM:
            assert process.returncode == 0, err
            assert "preempted (SIGTERM): checkpoint saved at step" in out
        elif signum == signal.SIGINT:  # Ctrl-C: the step ends, is saved, and the run stops
            assert process.returncode == 130, err
            notice, said = err.strip().splitlines()
            assert notice.startswith("t5scale: Ctrl-C: stopping after this step"), err
            assert said.startswith("t5scale: interrupted (Ctrl-C) after step"), err
            assert said.endswith("checkpoint saved; the same command resumes from it"), err
        else:
            assert process.returncode == -signal.SIGKILL
    final = _start(run_dir, precision, data)
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0, err
    assert "resuming from the checkpoint at step" in out
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err

    want, got = _read_metrics(tmp_path / "reference"), _read_metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, 13)), events
    assert [r["loss"] for r in got] == [r["loss"] for r in want], events  # bit-identical
    for saved in (_saved_params, _saved_fp8) if precision == "fp8" else (_saved_params,):
        got, want = saved(run_dir, 12), saved(tmp_path / "reference", 12)
        assert any(np.any(a) for a in got) and len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    print("kill and preemption steps:", events)


def test_ctrl_c_before_the_steps_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C while the step compiles (no compilation cache: a compile of some seconds). It was
    a traceback before (2026-11-29), a segmentation fault in Python's teardown, or, raised
    into JAX's callbacks, ignored: the run went on."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    process = subprocess.Popen(
        [sys.executable, "-m", "t5scale.cli", *_tiny(tmp_path, 4, "--cpu_devices=8")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout.readline().startswith("process 0: mesh")  # said before the compile
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert err.splitlines() == [
        "t5scale: interrupted (Ctrl-C): nothing saved since the last checkpoint"
    ]
    assert "step 1/" not in out


def test_a_model_dir_in_use_by_another_run_is_one_line(tmp_path, capsys):
    """Two runs on one MODEL_DIR wrote over each other's checkpoints and metrics, and one hung
    in a save (2026-11-29): the second now stops before it starts, naming the first. Here the
    first is this process, holding the run's lock as a run's process 0 does."""
    with model_dir_lock(str(tmp_path)):
        code, _, err = cli_in_process(_tiny(tmp_path, 2), capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"is in use by another run (process {os.getpid()} on {socket.gethostname()})" in err
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()


# Restore onto another layout: each layout trains 3 steps and saves; every other layout restores
# that checkpoint and trains steps 4 and 5, which must match the original layout's own.
LAYOUTS = {  # every stage, three mesh shapes, two device counts
    "stage0 2 devices zero=2": (ParallelConfig(zero_stage=0, zero=2), 2),
    "stage1 4 devices zero=2 tensor=2": (ParallelConfig(zero_stage=1, zero=2, tensor=2), 4),
    "stage2 4 devices zero=4": (ParallelConfig(zero_stage=2, zero=4), 4),
    "stage3 4 devices replica=2 zero=2": (ParallelConfig(zero_stage=3, replica=2, zero=2), 4),
}


@pytest.mark.parametrize(
    "names",
    [
        # Out of CI's budget: tests/test_multihost_training.py restores a checkpoint onto
        # another stage, mesh, device and process count in CI.
        pytest.param(
            ("stage0 2 devices zero=2", "stage3 4 devices replica=2 zero=2"),
            marks=pytest.mark.slow,
        ),
        pytest.param(tuple(LAYOUTS), marks=pytest.mark.slow, id="every-pair"),
    ],
    ids=["stage0-stage3", "every-pair"],
)
def test_a_checkpoint_restores_onto_other_stages_and_meshes(tmp_path, names):
    setups = {name: tiny_setup(*LAYOUTS[name]) for name in names}
    continued = {}
    # A meta as written before it held the run (and the sync): it restores as it did then.
    old_meta = {"step": 3, "data_position": 3, "optimizer": "adamw",
                "model": model_signature(TINY_MODEL)}  # fmt: skip
    for name, setup in setups.items():
        state, _ = run_steps(setup, setup.create_state(seed=0), 1, 3)
        checkpoints = Checkpoints(str(tmp_path / name), CheckpointConfig())
        checkpoints.manager.save(3, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(old_meta)
        ))  # fmt: skip
        checkpoints.close()
        _, continued[name] = run_steps(setup, state, 4, 5)
    for source in setups:
        for name, setup in setups.items():
            if name == source:
                continue
            checkpoints = Checkpoints(str(tmp_path / source), CheckpointConfig())
            restored = checkpoints.restore_latest(setup.state, TINY_MODEL, "adamw")
            checkpoints.close()
            assert restored.meta.step == 3
            _, losses = run_steps(setup, restored.state, 4, 5)
            np.testing.assert_allclose(
                losses, continued[source], rtol=1e-5, err_msg=f"{source} → {name}"
            )


def _tiny(model_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train", *TINY_ARGS, "--gin_file=gin/zero/stage2.gin", f"--gin.TRAIN_STEPS={steps}",
        f"--gin.MODEL_DIR='{model_dir}'", *extra,
    ]  # fmt: skip


def _largest_data_file(step: Path) -> str:
    """The largest of a checkpoint step's data files (ocdbt's d/, the root's or a process's)."""
    return max(glob.glob(f"{step}/state/**/d/*", recursive=True), key=os.path.getsize)


def _cut_in_half(data_file: str) -> None:
    with open(data_file, "r+b") as f:
        f.truncate(os.path.getsize(data_file) // 2)


def test_damaged_checkpoints_are_set_aside_and_the_run_resumes_from_a_good_one(tmp_path, capsys):
    code, _, _ = cli_in_process(_tiny(tmp_path, 6, "--gin.CHECKPOINT_EVERY=2"), capsys)
    assert code == 0
    first = _read_metrics(tmp_path)
    step_dir = tmp_path / "checkpoints"
    # Step 6: its largest data file cut in half (an array's, read shard by shard: orbax wraps
    # tensorstore's error in its own, and its abandoned reads each raised it again, 600 times,
    # before 2026-11-30); step 4: the state's manifest missing.
    _cut_in_half(_largest_data_file(step_dir / "6"))
    (step_dir / "4" / "state" / "manifest.ocdbt").unlink()
    with open(tmp_path / "metrics.jsonl", "ab") as metrics:  # a line damaged on disk
        metrics.write(b"\xff\xfe\x00 not UTF-8\n")  # (a traceback at resume before 2026-11-29)

    # In a process of its own, to its end: orbax's abandoned reads of a damaged checkpoint
    # report after the restore has failed (t5scale/train/checkpoint.py, _abandoned_reads_quiet).
    done = run_cli(*_tiny(tmp_path, 8, "--gin.CHECKPOINT_EVERY=2", "--cpu_devices=8"))
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = done.stderr.strip().splitlines()
    assert len(warnings) == 2 and all("is damaged" in line for line in warnings), done.stderr[
        -3000:
    ]
    # each says its innermost cause, not tensorstore's chain and spec
    assert "step 6 is damaged (OUT_OF_RANGE: Requested byte range" in warnings[0]
    assert "step 4 is damaged (NOT_FOUND: Metadata at" in warnings[1]
    assert "tensorstore_spec" not in done.stderr
    assert "resuming from the checkpoint at step 2" in done.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints_damaged").iterdir()) == ["4", "6"]
    again = _read_metrics(tmp_path)
    assert [r["step"] for r in again] == list(range(1, 9))
    assert [r["loss"] for r in again[:6]] == [r["loss"] for r in first]

    # export only reads: a damaged checkpoint is one line naming the steps it could export
    _cut_in_half(_largest_data_file(step_dir / "8"))
    out_dir = tmp_path / "exported"
    code, _, err = cli_in_process(["export", f"--gin.MODEL_DIR='{tmp_path}'",
                                   f"--out_dir={out_dir}"], capsys)  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert "checkpoints/8 is damaged (OUT_OF_RANGE: Requested byte range" in err, err
    assert "export another with --step (there are steps 4, 6)" in err, err
    assert (step_dir / "8").is_dir() and not out_dir.exists()

    # Every checkpoint damaged: the run stops rather than train afresh over the run (which would
    # cut its metrics back and drop a converted model's weights; a warning was its only trace)
    for step in (4, 6):
        (step_dir / str(step) / "state" / "manifest.ocdbt").unlink()
    code, out, err = cli_in_process(_tiny(tmp_path, 10, "--gin.CHECKPOINT_EVERY=2"), capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 4, err
    assert [line.split(" is damaged")[0] for line in lines[:3]] == [
        f"t5scale: warning: checkpoint step {step}" for step in (8, 6, 4)
    ]
    assert lines[3].startswith(f"t5scale: error: no checkpoint in {step_dir} restores: each was")
    assert "(steps 8, 6, 4); to train afresh, use another MODEL_DIR or empty this one" in lines[3]
    assert len(_read_metrics(tmp_path)) == 8 and "step 1/" not in out


def test_a_save_on_the_cpu_copies_whole_shards_and_compiles_nothing(tmp_path):
    """Replicated arrays on 8 CPU devices: orbax's replica-parallel save would cut each
    replica's slice with an eager jax slice (a program per shape, compiled at the first save);
    on the CPU t5scale saves whole shards, and they restore as they were."""
    mesh = jax.make_mesh((8,), ("zero",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = jax.device_put(
        np.arange(24 * 40, dtype=np.float32).reshape(24, 40), NamedSharding(mesh, P())
    )  # a shape no other test saves: its slices would be compiled here
    sharded = jax.device_put(np.arange(16.0, dtype=np.float32), NamedSharding(mesh, P("zero")))
    state = {"replicated": replicated, "sharded": sharded}
    compiled = []

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(seconds)

    checkpoints = Checkpoints(str(tmp_path), CheckpointConfig())
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        checkpoints.save(1, state, CheckpointMeta(step=1, model={}, optimizer="adamw"))
        checkpoints.manager.wait_until_finished()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
    assert compiled == []
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restored = checkpoints.restore(1, state=ocp.args.StandardRestore(target))["state"]
    for name, array in state.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(array))


def test_a_checkpoint_of_another_model_stops_at_start(tmp_path, capsys):
    assert cli_in_process(_tiny(tmp_path, 1), capsys)[0] == 0
    code, _, err = cli_in_process(_tiny(tmp_path, 2, "--gin.ModelConfig.d_ff=256"), capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "d_ff is 128 there and 256 in this run" in err


# `python -c` this, then t5scale's arguments: t5scale's CLI with no file over 256 kB written
# (RLIMIT_FSIZE, which binds root as well): a write past it fails with EFBIG, as on a full
# disk, not with a signal (SIGXFSZ ignored; both survive the exec). A wrapper process, not
# preexec_fn, which would fork pytest's threads.
_NO_FILE_OVER_256_KB = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
os.execv(sys.executable, [sys.executable, "-m", "t5scale.cli", *sys.argv[1:]])
"""


def test_a_save_that_fails_stops_the_run_in_one_line_and_does_not_hang(tmp_path):
    """Step 2's checkpoint cannot be written (no file over 256 kB): the run stops at the next
    save in one line, exit code 6. It hung before (2026-11-29): orbax's threads of the failed
    save wait for ever, and Python waits for them at exit; and orbax logged each thread's
    traceback."""
    # The compilation cache is read, not written: its files are over 256 kB too.
    env = os.environ | {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1e9"}
    args = _tiny(tmp_path, 6, "--gin.CHECKPOINT_EVERY=2", "--cpu_devices=8")
    done = subprocess.run(
        [sys.executable, "-c", _NO_FILE_OVER_256_KB, *args], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 6, done.stderr[-3000:]
    # Which of orbax's failed writes is raised is a race: tensorstore's cause comes with its
    # error code or without.
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        "t5scale: error: checkpoint step 2 was not saved (OUT_OF_RANGE: File too large"
    ), line
    assert line.endswith(
        f"the run stops, the checkpoints before it in {tmp_path / 'checkpoints'} are as they were"
    ), line
    assert "step 4/6" in done.stdout and "step 5/6" not in done.stdout  # stopped at the save
    assert not (tmp_path / "checkpoints" / "2").exists()


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="drops from root to nobody"
)
def test_a_model_dir_it_cannot_write_into_stops_the_run_before_it_trains(tmp_path):
    """As any user but root (here nobody, from root): the run would train until its first
    save, and lose it (a traceback before, 2026-11-29)."""
    base = Path(
        tempfile.mkdtemp(prefix="t5scale-unwritable-")
    )  # nobody reaches /tmp/X, not pytest's
    try:
        base.chmod(0o755)
        (base / "checkpoints").mkdir(mode=0o755)  # root's: nobody cannot write into it
        os.chown(base, 65534, 65534)
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                   sys.executable, "-m", "t5scale.cli", *_tiny(base, 2)]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(base)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        f"t5scale: error: MODEL_DIR '{base}': '{base / 'checkpoints'}' is not writable"
    ]
    assert "step 1" not in done.stdout


# CI: 'stop'; 'skip' (the same guard, which then goes on) under -m slow
@pytest.mark.parametrize("action", ["stop", pytest.param("skip", marks=pytest.mark.slow)])
def test_nan_or_inf_never_replaces_a_good_checkpoint(tmp_path, capsys, action):
    # A learning rate of 1e30 makes step 1's update overflow the next forward pass.
    args = _tiny(
        tmp_path, 4, "--gin.CHECKPOINT_EVERY=1", "--gin.CheckpointConfig.keep=10",
        "--gin.OptimizerConfig.learning_rate=1e30", "--gin.OptimizerConfig.warmup_steps=1",
        f"--gin.CheckpointConfig.on_nonfinite='{action}'",
    )  # fmt: skip
    code, _, err = cli_in_process(args, capsys)
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
    records = _read_metrics(tmp_path)
    bad = next(r["step"] for r in records if not np.isfinite(r["loss"]))
    if action == "stop":
        assert code == 3 and len(err.strip().splitlines()) == 1
        assert f"at step {bad}: stopped without saving" in err
        assert steps == list(range(1, bad))
    else:
        assert code == 0 and steps == [1, 2, 3, 4]
        assert records[-1]["skipped_steps"] == 4 - bad + 1
        saved = zip(_saved_params(tmp_path, 4), _saved_params(tmp_path, bad - 1), strict=True)
        for a, b in saved:
            np.testing.assert_array_equal(a, b)  # the skipped steps changed nothing


# Mixed precision and meshes the model's dimensions do not divide: what a checkpoint holds is the
# canonical form (fp32 parameters in the model's shapes), whatever wrote it.
def _run(model_dir: Path, devices: int, stage: int, precision: str, steps: int) -> list[str]:
    return [
        "train", *TINY_ARGS, f"--cpu_devices={devices}", f"--gin_file=gin/zero/stage{stage}.gin",
        f"--gin_file=gin/precision/{precision}.gin", "--gin.BATCH_SIZE=24",
        "--gin.CHECKPOINT_EVERY=2", f"--gin.TRAIN_STEPS={steps}", f"--gin.MODEL_DIR={model_dir}",
    ]  # fmt: skip


def _losses(model_dir: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in _read_metrics(model_dir)}


@pytest.mark.slow  # CI: the killed and preempted runs resume bit for bit (fp32, 8 devices)
def test_mixed_precision_on_a_padded_mesh_resumes_bit_for_bit(tmp_path):
    """6 devices pad every sharded tree; the checkpoint holds the fp32 master unpadded, and the
    run that resumes from it takes exactly the steps of the run that never stopped."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    for model_dir, steps in ((whole, 4), (stopped, 2), (stopped, 4)):
        done = run_cli(*_run(model_dir, 6, 3, "mixed", steps))
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from the checkpoint at step 2" in done.stdout
    assert _losses(stopped) == _losses(whole)  # bit for bit
    saved = ocp.StandardCheckpointer().restore(stopped / "checkpoints" / "2" / "state")
    model = TINY_MODEL.__class__()  # mt5_tiny's shapes, whatever the mesh
    assert saved["params"]["embedding"].shape == (model.vocab_size, model.d_model)
    assert {np.asarray(leaf).dtype for leaf in jax.tree.leaves(saved["params"])} == {
        np.dtype("float32")
    }


@pytest.mark.parametrize(
    "source, target",
    [
        # CI: test_fp8.py moves a checkpoint between precisions, test_multihost_training.py
        # onto another stage, mesh and process count
        pytest.param((8, 2, "mixed"), (6, 3, "fp32"), marks=pytest.mark.slow),
        pytest.param((6, 1, "fp32"), (8, 3, "mixed"), marks=pytest.mark.slow),
    ],
    ids=["mixed-8-devices-to-fp32-6", "fp32-6-devices-to-mixed-8"],
)
def test_a_checkpoint_moves_between_precisions_stages_and_device_counts(tmp_path, source, target):
    original, moved = tmp_path / "original", tmp_path / "moved"
    done = run_cli(*_run(original, *source, steps=4))
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.copytree(original / "checkpoints" / "2", moved / "checkpoints" / "2")
    done = run_cli(*_run(moved, *target, steps=4))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from the checkpoint at step 2" in done.stdout
    continued, reference = _losses(moved), _losses(original)
    assert sorted(continued) == [3, 4]
    # The same parameters go on in the other precision: bf16 against fp32 arithmetic.
    for step in (3, 4):
        assert abs(continued[step] / reference[step] - 1) < 1e-2, (continued, reference)
