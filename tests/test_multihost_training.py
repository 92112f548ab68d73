"""2 processes × 4 devices train like 1 process × 8 (real processes on 127.0.0.1), also with
several steps per execution, and a checkpoint written by 2 processes restores in 1 and training
goes on."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import LOCAL_SH, REPO, finish, process_env

RUN = [
    "train", "--gin_file=gin/models/mt5_tiny.gin", "--gin.DATA_SOURCE=synthetic",
    "--gin.INPUT_LENGTH=64", "--gin.TARGET_LENGTH=16", "--gin.BATCH_SIZE=8",
    "--gin.CHECKPOINT_EVERY=10",
]  # fmt: skip


def _start(
    command: list[str], model_dir: Path, steps: int, *extra: str, env: dict | None = None
) -> subprocess.Popen:
    return subprocess.Popen(
        [*command, *RUN, f"--gin.TRAIN_STEPS={steps}", f"--gin.MODEL_DIR='{model_dir}'", *extra],
        cwd=REPO, env=env or process_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def _one_process(model_dir: Path, steps: int, *extra: str) -> subprocess.Popen:
    return _start(
        [sys.executable, "-m", "t5scale.cli"], model_dir, steps, "--cpu_devices=8", *extra
    )


def _two_processes(
    model_dir: Path, steps: int, *extra: str, env: dict | None = None
) -> subprocess.Popen:
    return _start([LOCAL_SH, "2"], model_dir, steps, "--cpu_devices=4", *extra, env=env)


def _finish(*processes: subprocess.Popen) -> list[str]:
    outputs = []
    for code, output in finish(list(processes), timeout=400):
        assert code == 0, output[-4000:]
        outputs.append(output)
    return outputs


def _losses(model_dir: Path) -> dict[int, float]:
    records = map(json.loads, (model_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records}


STAGES = {n: f"--gin_file=gin/zero/stage{n}.gin" for n in (0, 1, 2, 3)}


def _assert_same_losses(run: Path, reference: Path, steps: range) -> None:
    want, got = _losses(reference), _losses(run)
    assert sorted(got) == list(steps), run.name
    got, ref = np.array([got[s] for s in steps]), np.array([want[s] for s in steps])
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    print(f"{run.name}: max relative difference {np.max(np.abs(got / ref - 1)):.2e}")


def test_two_processes_train_like_one_and_their_checkpoint_goes_on_in_one(tmp_path):
    one, hybrid = tmp_path / "one", tmp_path / "stage3"
    # One process × 8 devices, ZeRO-3, 12 steps without a break: the reference; beside it two
    # processes × 4 devices, ZeRO-3 on the hybrid mesh (a replica per process, zero inside),
    # 4 steps per execution (executions of 4, 4, 1 and 1 steps before the checkpoint at 10).
    # remat 'auto': both processes must compile the same policy (they agree on one).
    reference = _one_process(one, 12, STAGES[3])
    two = _two_processes(
        hybrid, 10, STAGES[3], "--gin.STEPS_PER_EXECUTION=4", "--gin.ModelConfig.remat='auto'"
    )
    _, output = _finish(reference, two)
    assert "[p1] process 1: mesh replica=2 × zero=4 × tensor=1 over 8 devices" in output
    remat = json.loads((hybrid / "step_analysis.json").read_text())["remat"]
    assert remat["requested"] == "auto" and remat["policy"] == "dots", remat
    # The ZeRO-3 checkpoint of step 10, written by two processes (each its own shards),
    # restores in one process under ZeRO-2 and trains steps 11 and 12.
    (resumed,) = _finish(_one_process(hybrid, 12, STAGES[2]))
    assert "resuming from the checkpoint at step 10" in resumed
    assert sorted(_losses(one)) == list(range(1, 13))
    _assert_same_losses(hybrid, one, range(1, 13))


@pytest.mark.slow  # out of CI's budget; CI: the mesh of two processes on one host
# (test_multihost.py)
@pytest.mark.parametrize("spread", ["zero across hosts", "one host"])
def test_zero_across_two_processes_trains_like_one(tmp_path, spread):
    """ZeRO-0 with the zero axis across both processes: data parallelism over all 8 devices,
    asked for (zero_across_hosts) or because both processes are on one host (one per GPU)."""
    one, across = tmp_path / "one", tmp_path / "stage0"
    if spread == "one host":
        two_runs = _two_processes(across, 6, STAGES[0], env=process_env(T5SCALE_HOST="node0"))
        spans = "2 processes on 1 host"
    else:
        two_runs = _two_processes(
            across, 6, STAGES[0], "--gin.ParallelConfig.zero_across_hosts=True"
        )
        spans = "zero across 2 processes"
    two, _ = _finish(two_runs, _one_process(one, 6, STAGES[3]))
    assert f"[p1] process 1: mesh replica=1 × zero=8 × tensor=1 over 8 devices, {spans}" in two
    _assert_same_losses(across, one, range(1, 7))


@pytest.mark.slow  # out of CI's budget; CI: each process's shard (test_multihost.py)
def test_pipeline_stages_across_processes_read_one_corpus_stream(tmp_path):
    """2 pipeline stages, one per process: both processes hold every row of the batch, so both
    read the one shard of the corpus's stream that one process reads (before 2026-11-30 each
    read half, and the step refused the half batch)."""
    one, two = tmp_path / "one", tmp_path / "two"
    corpus = [STAGES[1], "--gin.DATA_SOURCE='corpus'", "--gin.ParallelConfig.pipeline=2",
              "--gin.MICRO_BATCHES=2"]  # fmt: skip
    output, _ = _finish(_two_processes(two, 3, *corpus), _one_process(one, 3, *corpus))
    assert "replica=1 × pipeline=2 × zero=4 × tensor=1 over 8 devices" in output
    _assert_same_losses(two, one, range(1, 4))


DILOCO = [
    STAGES[2], "--gin.ParallelConfig.replica=2", "--gin.ReplicaSyncConfig.mode='diloco'",
    "--gin.ReplicaSyncConfig.every=4",
]  # fmt: skip


@pytest.mark.slow  # CI: DiLoCo in one process (test_replicas.py), two processes at ZeRO-3 above
def test_diloco_with_a_replica_per_process_trains_like_one_process(tmp_path):
    """DiLoCo, H = 4, over 2 processes × 4 devices (each process one replica, ZeRO-2 inside, two
    steps per execution): two periods, the same losses as one process × 8 devices, and the
    checkpoint of its per-replica state (each process writing its replica's shards) goes on in
    one process."""
    one, two = tmp_path / "one", tmp_path / "two"
    # Two steps per execution on the two processes: an execution never crosses an outer step.
    two_runs = _two_processes(two, 8, *DILOCO, "--gin.STEPS_PER_EXECUTION=2")
    output, _ = _finish(two_runs, _one_process(one, 10, *DILOCO))
    assert "[p1] process 1: mesh replica=2 × zero=4 × tensor=1 over 8 devices" in output
    (resumed,) = _finish(_one_process(two, 10, *DILOCO))
    assert "resuming from the checkpoint at step 8" in resumed
    _assert_same_losses(two, one, range(1, 11))
