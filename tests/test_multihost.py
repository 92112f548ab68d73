"""Multi-host: where a process finds its place and its host, the mesh across hosts, and real
clusters of processes on 127.0.0.1 — start-up from each source, an unreachable coordinator, a
process lost, SIGTERM reaching only one process."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import LOCAL_SH, REPO, finish, free_port, process_env, read_scalars
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5scale.data.loader import data_shard
from t5scale.errors import MeshError
from t5scale.parallel.distributed import (
    PROCESSES_FAILED,
    DistributedConfig,
    DistributedError,
    first_slurm_host,
    host_name,
    resolve_processes,
)
from t5scale.parallel.mesh import ParallelConfig, hybrid_grid
from t5scale.target import Target
from t5scale.xla_gpu import GpuTopology, cuda_plugin_installed

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NODELIST": "gpu[003-008,011],login2",
    "SLURM_STEP_NUM_NODES": "2",
}


# --- where a process finds its place: pure functions of the settings and the environment ---


def test_nothing_set_is_one_process():
    assert resolve_processes(DistributedConfig(), {}).source == "single"
    one = {"T5SCALE_NUM_PROCESSES": "1"}
    assert not resolve_processes(DistributedConfig(), one).multi_process


def test_explicit_settings_come_from_config_before_the_environment():
    env = {
        "T5SCALE_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "T5SCALE_NUM_PROCESSES": "4",
        "T5SCALE_PROCESS_ID": "3",
    }
    spec = resolve_processes(DistributedConfig(), env)
    assert (spec.source, spec.coordinator_address, spec.num_processes, spec.process_id) == (
        "explicit", "10.0.0.1:1234", 4, 3,
    )  # fmt: skip
    spec = resolve_processes(DistributedConfig(process_id=0, coordinator_address="h:9"), env)
    assert (spec.coordinator_address, spec.process_id) == ("h:9", 0)


@pytest.mark.parametrize(
    "nodelist, host",
    [("node001", "node001"), ("a1,b2", "a1"), ("gpu[003-008,011],x", "gpu003"),
     ("n[7,9]", "n7"), ("127.0.0.1", "127.0.0.1")],
)  # fmt: skip
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_slurm_step_gives_every_setting():
    spec = resolve_processes(DistributedConfig(), SLURM)
    assert spec.source == "slurm"
    assert (spec.num_processes, spec.process_id) == (16, 9)
    assert spec.coordinator_address == f"gpu003:{61440 + 4242 % 4096}"
    assert spec.local_device_ids == (1,)  # 16 tasks on 2 nodes: one GPU per task
    # ... unless SLURM bound one GPU to each task: then the task drives the one it sees
    bound = resolve_processes(DistributedConfig(), SLURM | {"CUDA_VISIBLE_DEVICES": "5"})
    assert bound.local_device_ids is None
    every = resolve_processes(DistributedConfig(), SLURM | {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert every.local_device_ids == (1,)
    per_node = resolve_processes(
        DistributedConfig(),
        SLURM | {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "T5SCALE_COORDINATOR_PORT": "999"},
    )
    assert per_node.local_device_ids is None  # one task per node drives all its GPUs
    assert per_node.coordinator_address == "gpu003:999"


def test_slurm_batch_script_outside_srun_is_one_process():
    outside = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    assert resolve_processes(DistributedConfig(), outside).source == "single"


def test_kubernetes_indexed_job_index_is_the_process_id():
    env = {
        "JOB_COMPLETION_INDEX": "2",
        "T5SCALE_COORDINATOR_ADDRESS": "t5scale-0.t5scale:8476",
        "T5SCALE_NUM_PROCESSES": "4",
    }
    spec = resolve_processes(DistributedConfig(), env)
    assert (spec.source, spec.process_id, spec.num_processes) == ("kubernetes", 2, 4)


@pytest.mark.parametrize(
    "config, env, says",
    [
        (DistributedConfig(num_processes=2), {}, "--coordinator_address"),
        (DistributedConfig(), {"JOB_COMPLETION_INDEX": "0", "T5SCALE_NUM_PROCESSES": "2"},
         "needs --coordinator_address"),
        (DistributedConfig(num_processes=2, coordinator_address="h:1"),
         {"T5SCALE_PROCESS_ID": "2"}, "outside 0..1"),
        (DistributedConfig(num_processes=2, process_id=0, coordinator_address="h"), {},
         "not host:port"),
        (DistributedConfig(), {"T5SCALE_NUM_PROCESSES": "two"}, "must be an integer"),
        # a pod past the first whose manifest lost its settings: not a run of its own
        (DistributedConfig(), {"JOB_COMPLETION_INDEX": "3"}, "pod 3 needs T5SCALE_NUM_PROCESSES"),
    ],
)  # fmt: skip
def test_incomplete_or_wrong_settings_are_one_clear_error(config, env, says):
    with pytest.raises(DistributedError, match=says):
        resolve_processes(config, env)


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"num_processes": 0}, "num_processes must be >= 1, got 0"),  # not "unset" (None is)
        ({"num_processes": 1, "process_id": 3}, "process_id must be >= 0 and below num_processes"),
        ({"process_id": -1}, "process_id must be >= 0, got -1"),
        ({"num_processes": "2"}, "num_processes must be an integer or None, got '2'"),
    ],
)
def test_config_counts_are_checked_when_given(fields, says):
    with pytest.raises(ValueError, match=says):
        DistributedConfig(**fields)


def test_config_num_processes_wins_over_the_environment():
    spec = resolve_processes(DistributedConfig(num_processes=1), {"T5SCALE_NUM_PROCESSES": "4"})
    assert spec.source == "single" and spec.num_processes == 1


def test_lost_after_must_come_before_jax_heartbeat_timeout():
    with pytest.raises(DistributedError, match="below heartbeat_timeout_s"):
        DistributedConfig(lost_after_s=100, heartbeat_timeout_s=100)


def test_mesh_puts_replica_across_hosts_unless_zero_is_asked():
    # (replica, pipeline, zero, tensor)
    assert ParallelConfig().resolve(16, dcn_groups=2) == (2, 1, 8, 1)
    assert ParallelConfig(zero_across_hosts=True).resolve(16, dcn_groups=2) == (1, 1, 16, 1)
    assert ParallelConfig(tensor=2).resolve(16, dcn_groups=4) == (4, 1, 2, 2)
    with pytest.raises(MeshError, match="must be a multiple of the 2 hosts"):
        ParallelConfig(replica=1).resolve(16, dcn_groups=2)


def test_a_process_finds_its_host_from_the_setting_slurm_or_the_emulation():
    slurm = resolve_processes(DistributedConfig(), SLURM)
    assert host_name(slurm, "gpu", {"T5SCALE_HOST": "rack1-node7"} | SLURM) == "rack1-node7"
    assert host_name(slurm, "gpu", SLURM | {"SLURMD_NODENAME": "gpu004"}) == "gpu004"
    assert host_name(slurm, "gpu", SLURM | {"SLURM_NODEID": "1"}) == "1"
    # launch/local.sh inside an srun allocation: SLURM did not start these processes
    local = resolve_processes(DistributedConfig(num_processes=2, process_id=1,
                                                coordinator_address="127.0.0.1:1"), {})  # fmt: skip
    assert host_name(local, "cpu", SLURM | {"SLURMD_NODENAME": "gpu004"}) == "process 1"


@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs jax's CUDA plugin (gpu-compile)")
def test_a_host_with_a_process_per_gpu_keeps_zero_inside_it():
    # 4 processes of 2 GPUs: as 4 hosts, the grid is mesh_utils' hybrid mesh, process by process.
    devices = GpuTopology("h100_sxm", nodes=4, gpus_per_node=2).devices()
    by_process = Target.compile_only_gpus(GpuTopology("h100_sxm", 4, 2)).host_groups()
    assert [[d.process_index for d in host] for host in by_process] == [
        [0, 0],
        [1, 1],
        [2, 2],
        [3, 3],
    ]
    expected = mesh_utils.create_hybrid_device_mesh(
        (1, 1, 2, 1), (4, 1, 1, 1), devices, process_is_granule=True
    )
    assert (hybrid_grid((1, 1, 2, 1), (4, 1, 1, 1), by_process) == expected).all()
    # The same devices as 2 hosts, each of 2 processes: replica across the hosts, zero over the
    # 4 GPUs of a host, its processes in order.
    hosts = [devices[:4], devices[4:]]
    grid = hybrid_grid((1, 1, 4, 1), (2, 1, 1, 1), hosts)
    processes = np.vectorize(lambda d: d.process_index)(grid).reshape(2, 4)
    assert processes.tolist() == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert ParallelConfig(zero_stage=2).resolve(8, dcn_groups=2) == (2, 1, 4, 1)


@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs jax's CUDA plugin (gpu-compile)")
@pytest.mark.parametrize(
    "config, hosts, shards",
    [
        # a replica per node: each process its own block of rows, its own shard
        (ParallelConfig(), [[0], [1], [2], [3]], [(0, 4), (1, 4), (2, 4), (3, 4)]),
        # two nodes of two processes (one per GPU pair), zero inside each: four blocks
        (ParallelConfig(), [[0, 1], [2, 3]], [(0, 4), (1, 4), (2, 4), (3, 4)]),
        # pipeline stages across nodes (a replica's two stages on nodes 0, 1): a replica's two
        # processes hold the same rows, so they read the same shard (before 2026-11-30: a shape
        # error at the first step)
        (ParallelConfig(pipeline=2), [[0], [1], [2], [3]], [(0, 2), (0, 2), (1, 2), (1, 2)]),
        # tensor across a node's two processes: both hold the same rows
        (ParallelConfig(tensor=4), [[0, 1], [2, 3]], [(0, 2), (0, 2), (1, 2), (1, 2)]),
    ],
)  # fmt: skip
def test_processes_holding_the_same_rows_read_the_same_shard(config, hosts, shards):
    devices = GpuTopology("h100_sxm", nodes=4, gpus_per_node=2).devices()
    by_host = [[d for d in devices if d.process_index in group] for group in hosts]
    shape = config.resolve(8, dcn_groups=len(hosts))
    dcn = config.hosts_per_axis(shape, len(hosts))
    inside = tuple(s // d for s, d in zip(shape, dcn, strict=True))
    mesh = Mesh(hybrid_grid(inside, dcn, by_host), ("replica", "pipeline", "zero", "tensor"))
    sharding = NamedSharding(mesh, P(("replica", "zero")))
    assert [data_shard(sharding, 16, process) for process in range(4)] == shards


def test_pipeline_stages_span_the_hosts_the_replicas_leave():
    # TP inside a node, PP across nodes: 4 nodes of 8, one replica, 4 stages.
    config = ParallelConfig(pipeline=4, tensor=8)
    assert config.resolve(32, dcn_groups=4) == (1, 4, 1, 8)
    assert config.hosts_per_axis((1, 4, 1, 8), 4) == (1, 4, 1, 1)
    # Two replicas over 8 nodes: each replica's 4 stages span 4 of them.
    two = ParallelConfig(replica=2, pipeline=4, tensor=8)
    assert two.hosts_per_axis(two.resolve(64, dcn_groups=8), 8) == (2, 4, 1, 1)
    with pytest.raises(MeshError, match="times pipeline=3 spans the hosts"):
        ParallelConfig(replica=1, pipeline=3, tensor=8).resolve(24 * 2, dcn_groups=4)


# --- real clusters of processes on 127.0.0.1 ---


def _processes(count: int, args: list[str], env_of) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, "-u", "-m", "t5scale.cli", *args],
            cwd=REPO,
            env=env_of(i),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]


def test_local_sh_runs_a_two_process_cluster():
    started = time.perf_counter()
    result = subprocess.run(
        [LOCAL_SH, "2", "t5scale", "distributed-check", "--cpu_devices=4"],
        cwd=REPO, env=process_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for i in (0, 1):
        assert f"[p{i}] process {i}/2 (explicit)" in output
        assert f"[p{i}] process {i}: mesh replica=2 × zero=4 × tensor=1 over 8 devices" in output
        assert f"process {i} holds replica {i}, zero 0-3" in output  # hybrid: a replica per host
        assert (
            f"[p{i}] process {i}: distributed ok: 2 processes, 8 devices, all-reduce 12" in output
        )
        assert f"local.sh: process {i} of 2 exited normally" in output
    print(f"2-process distributed-check through local.sh: {elapsed:.1f} s wall")


# CI: SLURM, two tasks on one node (one process per GPU, as sbatch --ntasks-per-node=8 makes
# them): one host, so ZeRO spans both processes. Kubernetes: its pods' settings are read by the
# tests above and from the manifest (test_launch.py); each pod a host.
@pytest.mark.parametrize("source", ["slurm", pytest.param("kubernetes", marks=pytest.mark.slow)])
def test_scheduler_environments_start_the_cluster(source):
    port = free_port()

    def env_of(i: int) -> dict:
        if source == "slurm":
            return process_env(
                SLURM_JOB_ID="77", SLURM_NTASKS="2", SLURM_PROCID=str(i), SLURM_LOCALID=str(i),
                SLURM_STEP_NODELIST="127.0.0.1", SLURM_STEP_NUM_NODES="1", SLURMD_NODENAME="n0",
                T5SCALE_COORDINATOR_PORT=str(port),
            )  # fmt: skip
        return process_env(
            JOB_COMPLETION_INDEX=str(i),
            T5SCALE_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            T5SCALE_NUM_PROCESSES="2",
        )

    args = ["distributed-check", "--cpu_devices=2"]
    if source == "kubernetes":  # ZeRO over the hosts, each pod one
        args.append("--gin.ParallelConfig.zero_across_hosts=True")
    spans = {"slurm": "2 processes on 1 host", "kubernetes": "zero across 2 processes"}[source]
    for i, (code, output) in enumerate(finish(_processes(2, args, env_of))):
        assert code == 0, output
        assert f"process {i}/2 ({source})" in output
        assert f"mesh replica=1 × zero=4 × tensor=1 over 4 devices, {spans};" in output
        assert f"process {i} holds zero {2 * i}-{2 * i + 1}" in output
        assert "distributed ok: 2 processes, 4 devices" in output


@pytest.mark.parametrize(
    "process, said",
    [
        (1, "could not reach the coordinator at 127.0.0.1:"),
        # process 0 is the coordinator, and its peer never comes: JAX aborted it in C++ (exit
        # 134, a stack dump) before 2026-11-29
        (0, "process 0 of 2: not every process joined at 127.0.0.1:"),
    ],
)
def test_unreachable_coordinator_fails_within_the_timeout_in_one_line(process, said):
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "t5scale.cli", "distributed-check", "--cpu_devices=1",
         f"--coordinator_address=127.0.0.1:{free_port()}", "--num_processes=2",
         f"--process_id={process}", "--gin.DistributedConfig.init_timeout_s=3"],
        cwd=REPO, env=process_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    assert result.returncode == PROCESSES_FAILED, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert said in lines[0]
    assert "within 3 s" in lines[0]
    assert elapsed < 20  # 3 s of trying, plus starting Python and JAX


# Training long enough to be killed in the middle; a smaller mt5_tiny to compile quickly.
LONG_RUN = [
    "train", "--cpu_devices=2", "--gin_file=gin/models/mt5_tiny.gin",
    "--gin_file=gin/zero/stage3.gin", "--gin.DATA_SOURCE=synthetic",
    "--gin.ModelConfig.num_encoder_layers=1", "--gin.ModelConfig.num_decoder_layers=1",
    "--gin.INPUT_LENGTH=32", "--gin.TARGET_LENGTH=8", "--gin.BATCH_SIZE=8",
    "--gin.TRAIN_STEPS=100000", "--gin.DistributedConfig.lost_after_s=5",
    "--gin.DistributedConfig.heartbeat_timeout_s=30",
]  # fmt: skip


def _explicit(port: int):
    return lambda i: process_env(
        T5SCALE_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        T5SCALE_NUM_PROCESSES="2",
        T5SCALE_PROCESS_ID=str(i),
    )


def _wait_for_step(model_dir: Path, step: int, processes, timeout: float = 180) -> None:
    metrics = model_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= step:
            return
        if any(p.poll() is not None for p in processes):
            raise AssertionError(finish(processes))
        time.sleep(0.1)
    for p in processes:
        p.kill()
    raise AssertionError(f"step {step} never came")


def test_a_killed_process_is_named_and_the_others_stop_within_seconds(tmp_path):
    processes = _processes(2, [*LONG_RUN, f"--gin.MODEL_DIR='{tmp_path}'"], _explicit(free_port()))
    _wait_for_step(tmp_path, 2, processes)
    processes[1].kill()
    killed = time.perf_counter()
    code, output = finish(processes[:1], timeout=60)[0]
    took = time.perf_counter() - killed
    assert code == PROCESSES_FAILED, output
    assert (
        "t5scale: error: process 1 of 2 was lost: no sign of life for 5 s "
        "(killed, crashed, or its host is down); process 0 stops"
    ) in output
    assert took < 30
    print(f"survivor exited {took:.1f} s after process 1 was killed")
    # TensorBoard's events come from process 0 alone (one writer, one file), its steps all there
    (events,) = (tmp_path / "train").glob("events.out.tfevents.*")
    assert [step for step, _ in read_scalars(events.parent)["loss"]][:2] == [1, 2]


@pytest.mark.slow  # out of CI's budget: run with -m slow
def test_a_killed_coordinator_ends_the_others_and_local_sh_names_it(tmp_path):
    launcher = subprocess.Popen(
        [LOCAL_SH, "2", *LONG_RUN, f"--gin.MODEL_DIR='{tmp_path}'"],
        cwd=REPO, env=process_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    _wait_for_step(tmp_path, 2, [launcher])
    coordinator = _process_in_session(launcher.pid, process_id=0)
    os.kill(coordinator, signal.SIGKILL)
    killed = time.perf_counter()
    output, _ = launcher.communicate(timeout=90)
    took = time.perf_counter() - killed
    assert launcher.returncode != 0
    assert "local.sh: process 0 of 2 was killed by signal 9 (SIGKILL)" in output
    assert "local.sh: process 1 of 2 was killed by signal 6 (SIGABRT)" in output, output[-3000:]
    # JAX's runtime client ends the survivor as soon as the coordinator's socket closes.
    assert "Terminating process because the JAX distributed service detected fatal" in output
    assert took < 30
    print(f"survivor exited {took:.1f} s after the coordinator was killed")


def _process_in_session(session: int, process_id: int) -> int:
    """The pid of t5scale process `process_id` among those local.sh started in `session`."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(entry)) != session:
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"t5scale.cli" in cmdline and f"T5SCALE_PROCESS_ID={process_id}".encode() in environ:
            return int(entry)
    raise AssertionError(f"no t5scale process {process_id} in session {session}")


@pytest.mark.slow  # out of CI's budget: run with -m slow
def test_sigterm_to_one_process_saves_the_same_step_on_all(tmp_path):
    run = [*LONG_RUN, f"--gin.MODEL_DIR='{tmp_path}'"]
    processes = _processes(2, run, _explicit(free_port()))
    _wait_for_step(tmp_path, 2, processes)
    processes[1].send_signal(signal.SIGTERM)  # as if only its node were preempted
    results = finish(processes)
    saved = [int(step) for step in os.listdir(tmp_path / "checkpoints") if step.isdigit()]
    assert len(saved) == 1, saved
    for code, output in results:
        assert code == 0, output
        assert f"preempted (SIGTERM): checkpoint saved at step {saved[0]}" in output
