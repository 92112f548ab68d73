"""Which process am I: JAX's distributed runtime, started from what the environment says.

`resolve_processes` reads, for each of coordinator address, process count and process id, the
first of: DistributedConfig (gin, or the CLI's --coordinator_address/--num_processes/
--process_id), the T5SCALE_* environment variables, and the scheduler — SLURM (`srun`) or a
Kubernetes Indexed Job (its JOB_COMPLETION_INDEX). Nothing at all means one process, which needs
no runtime. `join_processes` then calls jax.distributed.initialize with a bounded timeout.

Why not JAX's own detection: for SLURM it always makes each process see one GPU, which is wrong
for one process per node; and it does not say where its settings came from.

Once started, `PeerWatch` keeps every process honest about the others. Each process writes a
sign of life into the runtime's key-value store every second; a peer silent for `lost_after_s`
(killed, crashed, host gone) or marked failed is named in one line and this process exits with
PROCESSES_FAILED, before JAX's own, later heartbeat timeout would abort it with a stack dump. A
process that fails with a Python error marks itself failed and exits at once, without JAX's
shutdown barrier, which would otherwise keep it — and the peers waiting on it in a collective —
for minutes. The one loss JAX reports before we can is the coordinator's (process 0): the
others' runtime clients abort at once with "Terminating process because the JAX distributed
service detected fatal errors"; launch/local.sh and srun then say which process died.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Mapping

import jax

from t5scale.errors import (
    PROCESSES_FAILED,
    DistributedError,
    JoinError,
    check_field_types,
    leave_now,
)
from t5scale.target import Target, set_process_hosts

ENV_PREFIX = "T5SCALE_"
_KEY = "t5scale/peer/"
_HOST_KEY = "t5scale/host/"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins the others; unset fields come from the environment.

    coordinator_address: host:port of process 0, which runs JAX's coordination service.
    init_timeout_s: how long to wait for the coordinator and every process to connect.
    heartbeat_timeout_s: JAX's own limit, after which its runtime aborts every process.
    lost_after_s: t5scale's limit for a silent peer; below heartbeat_timeout_s, so that the
        loss is reported by name and in one line.
    local_device_ids: the accelerators this process drives (default: all it sees; under SLURM
        with several tasks per node, the one at SLURM_LOCALID).
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    init_timeout_s: int = 300
    heartbeat_timeout_s: int = 100
    lost_after_s: int = 60
    local_device_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        count, process = self.num_processes, self.process_id
        if count is not None and count < 1:  # 0 is not "unset": that is None
            raise DistributedError(f"DistributedConfig.num_processes must be >= 1, got {count}")
        if process is not None and (process < 0 or count is not None and process >= count):
            bound = "" if count is None else f" and below num_processes ({count})"
            raise DistributedError(
                f"DistributedConfig.process_id must be >= 0{bound}, got {process}"
            )
        if self.local_device_ids is not None:  # gin gives a list
            object.__setattr__(self, "local_device_ids", tuple(self.local_device_ids))
        if not 0 < self.lost_after_s < self.heartbeat_timeout_s:
            raise DistributedError(
                f"DistributedConfig.lost_after_s ({self.lost_after_s}) must be positive and "
                f"below heartbeat_timeout_s ({self.heartbeat_timeout_s})"
            )
        if self.init_timeout_s < 1:
            raise DistributedError("DistributedConfig.init_timeout_s must be at least 1 second")


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where the settings came from ('single', 'explicit', 'slurm', 'kubernetes') and what they are."""

    source: str
    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None
    local_device_ids: tuple[int, ...] | None = None

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What one source (the config and T5SCALE_* variables, or the scheduler) says of this
    process's place; None: that source does not say. Checked once all are read."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None

    def or_else(self, fallback: _Settings) -> _Settings:
        """These settings, with `fallback`'s where these do not say."""

        def first(mine, theirs):
            return theirs if mine is None else mine

        return _Settings(
            coordinator_address=first(self.coordinator_address, fallback.coordinator_address),
            num_processes=first(self.num_processes, fallback.num_processes),
            process_id=first(self.process_id, fallback.process_id),
            local_device_ids=first(self.local_device_ids, fallback.local_device_ids),
        )

    @property
    def missing(self) -> list[str]:
        """The names of the settings a multi-process run needs that no source gave."""
        needed = (
            ("coordinator_address", self.coordinator_address),
            ("num_processes", self.num_processes),
            ("process_id", self.process_id),
        )
        return [name for name, value in needed if value is None]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-008,011],login2' → 'gpu003'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise DistributedError(f"cannot read a host from SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + re.split(r"[,-]", ranges)[0]


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    """The integer the environment variable `name` holds: None when it is unset or empty."""
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name} must be an integer, got {value!r}") from None


def _from_slurm(env: Mapping[str, str]) -> _Settings:
    """Settings from an `srun` step (SLURM sets these in every task it starts)."""
    count = _env_int(env, "SLURM_NTASKS")
    nodes = _env_int(env, "SLURM_STEP_NUM_NODES") or _env_int(env, "SLURM_NNODES")
    # A port that the tasks agree on without talking, different per job on shared nodes, and
    # above Linux's ephemeral ports (32768-60999), which outgoing connections may hold (JAX's
    # own SLURM detection picks from the same range).
    port = env.get(f"{ENV_PREFIX}COORDINATOR_PORT") or str(
        61440 + _env_int(env, "SLURM_JOB_ID") % 4096
    )
    local_ids = None
    # Several tasks per node: one GPU each, by SLURM_LOCALID among the GPUs every task sees
    # (sbatch --gpus-per-node). Where SLURM binds one GPU to each task (--gpus-per-task=1,
    # --gpu-bind) the task sees only its own: it drives all it sees.
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if nodes and count and count > nodes and len(visible) != 1:
        local_ids = (_env_int(env, "SLURM_LOCALID"),)
    return _Settings(
        coordinator_address=f"{first_slurm_host(env['SLURM_STEP_NODELIST'])}:{port}",
        num_processes=count,
        process_id=_env_int(env, "SLURM_PROCID"),
        local_device_ids=local_ids,
    )


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    needed = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    return all(k in env for k in needed) and "SLURM_STEP_NODELIST" in env


def resolve_processes(
    config: DistributedConfig, env: Mapping[str, str] | None = None
) -> ProcessSpec:
    """This process's place among the processes, or a DistributedError that names what is missing."""
    env = os.environ if env is None else env
    settings = _Settings(
        coordinator_address=config.coordinator_address
        or env.get(f"{ENV_PREFIX}COORDINATOR_ADDRESS")
        or None,
        num_processes=config.num_processes
        if config.num_processes is not None
        else _env_int(env, f"{ENV_PREFIX}NUM_PROCESSES"),
        process_id=config.process_id
        if config.process_id is not None
        else _env_int(env, f"{ENV_PREFIX}PROCESS_ID"),
        local_device_ids=config.local_device_ids,
    )
    source = "explicit"
    if _in_slurm_step(env) and (_env_int(env, "SLURM_NTASKS") or 0) > 1:
        source = "slurm"
        settings = settings.or_else(_from_slurm(env))
    elif "JOB_COMPLETION_INDEX" in env and settings.process_id is None:
        source = "kubernetes"  # an Indexed Job: the pod's index is the process id
        index = _env_int(env, "JOB_COMPLETION_INDEX")
        settings = dataclasses.replace(settings, process_id=index)
        if index and settings.num_processes is None and settings.coordinator_address is None:
            # pod 3 of a job whose manifest lost its settings: not a run of its own
            raise DistributedError(
                f"a Kubernetes Indexed Job's pod {index} needs {ENV_PREFIX}NUM_PROCESSES and "
                f"{ENV_PREFIX}COORDINATOR_ADDRESS (launch/k8s/t5scale-job.yaml sets them)"
            )
    if settings.num_processes in (None, 1) and settings.coordinator_address is None:
        return ProcessSpec("single")
    if missing := settings.missing:
        flags = ", ".join(f"--{m} (or {ENV_PREFIX}{m.upper()})" for m in missing)
        kind = {"explicit": "a multi-process run", "slurm": "a SLURM multi-process run",
                "kubernetes": "a Kubernetes multi-process run"}[source]  # fmt: skip
        raise DistributedError(f"{kind} needs {flags}")
    count, process = settings.num_processes, settings.process_id
    if count < 1 or not 0 <= process < count:
        raise DistributedError(
            f"process id {process} is outside 0..{count - 1} ({count} processes)"
        )
    address = settings.coordinator_address
    if not re.fullmatch(r".+:\d+", address):
        raise DistributedError(f"coordinator address {address!r} is not host:port")
    return ProcessSpec(
        source, num_processes=count, process_id=process, coordinator_address=address,
        local_device_ids=settings.local_device_ids,
    )  # fmt: skip


def join_processes(config: DistributedConfig, env: Mapping[str, str] | None = None) -> PeerWatch:
    """Join the other processes (nothing to do for one process); log who this process is, once."""
    spec = resolve_processes(config, env)
    if not spec.multi_process:
        return PeerWatch(spec, None, config.lost_after_s)
    started = time.perf_counter()
    if spec.process_id != 0:  # process 0 starts the coordinator inside initialize
        _wait_for_coordinator(spec, config.init_timeout_s)
    # JAX's coordination service aborts process 0 (a C++ fatal, a stack dump, exit 134) when a
    # process never registers: this watch says so in one line first, and JAX gets longer.
    watch = threading.Timer(config.init_timeout_s, _not_joined, (spec, config.init_timeout_s))
    watch.daemon = True
    watch.start()
    try:
        jax.distributed.initialize(
            spec.coordinator_address,
            spec.num_processes,
            spec.process_id,
            local_device_ids=spec.local_device_ids,
            cluster_detection_method="deactivate",  # resolve_processes has decided
            initialization_timeout=config.init_timeout_s + JOIN_GRACE_S,
            heartbeat_timeout_seconds=config.heartbeat_timeout_s,
        )
    except Exception as error:  # noqa: BLE001  (JAX raises its runtime's error types)
        reason = " ".join(str(error).split())[:300]
        raise JoinError(
            f"process {spec.process_id} of {spec.num_processes} could not join the processes at "
            f"{spec.coordinator_address} within {config.init_timeout_s} s: {reason}"
        ) from None
    finally:
        watch.cancel()
    # Private: the runtime's key-value store, which PeerWatch writes its signs of life to.
    from jax._src import distributed

    client = distributed.global_state.client
    devices = jax.local_devices()
    platform = Target.of(devices).platform
    host = host_name(spec, platform, os.environ if env is None else env)
    set_process_hosts(_exchange_hosts(client, spec, host, config.lost_after_s))
    print(
        f"process {spec.process_id}/{spec.num_processes} ({spec.source}) on "
        f"{socket.gethostname()}: {len(devices)} local {platform} devices "
        f"{_id_ranges([d.id for d in devices])}, {jax.device_count()} in all; joined "
        f"{spec.coordinator_address} in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    watch = PeerWatch(spec, client, config.lost_after_s)
    watch.start()
    return watch


def host_name(spec: ProcessSpec, platform: str, env: Mapping[str, str]) -> str:
    """The host this process is on, which the mesh keeps together (Target.host_groups):
    T5SCALE_HOST if set; else, where SLURM started the processes, the task's node; else, on
    emulated CPU devices, the process itself (each process emulates a host); else the machine's
    name. Processes on one host (one per GPU) are then one group, with `zero` inside it, not
    `replica` across them."""
    if env.get(f"{ENV_PREFIX}HOST"):
        return env[f"{ENV_PREFIX}HOST"]
    if spec.source == "slurm" and (node := env.get("SLURMD_NODENAME") or env.get("SLURM_NODEID")):
        return node
    if platform == "cpu":
        return f"process {spec.process_id}"
    return socket.gethostname()


def _exchange_hosts(client, spec: ProcessSpec, host: str, timeout_s: float) -> list[str]:
    """Every process's host, by process id, through the runtime's key-value store: each sets
    its own, all meet at a barrier, each reads the directory once (three calls a process, not
    one per peer); a peer that does not arrive within `timeout_s` is lost."""
    try:
        client.key_value_set(f"{_HOST_KEY}{spec.process_id}", host)
        client.wait_at_barrier("t5scale_hosts", int(timeout_s * 1000))
        said = dict(client.key_value_dir_get(_HOST_KEY))
        return [said[f"{_HOST_KEY}{process}"] for process in range(spec.num_processes)]
    except Exception as error:  # noqa: BLE001  (the runtime's error types)
        reason = " ".join(str(error).split())[:200]
        raise JoinError(
            f"process {spec.process_id} of {spec.num_processes}: not every process said its "
            f"host within {timeout_s:g} s of joining ({reason})"
        ) from None


JOIN_GRACE_S = 15  # JAX's own timeout past t5scale's, so that t5scale's watch speaks first


def _not_joined(spec: ProcessSpec, timeout_s: float) -> None:
    """The join's watch: one line and exit code 4, from its thread, where JAX would abort."""
    leave_now(
        f"t5scale: error: process {spec.process_id} of {spec.num_processes}: not every process "
        f"joined at {spec.coordinator_address} within {timeout_s:g} s (one that never started, "
        "or a --num_processes larger than the processes started?)",
        PROCESSES_FAILED,
    )


def _wait_for_coordinator(spec: ProcessSpec, timeout_s: float) -> None:
    """Until the coordinator's port accepts a connection, or a JoinError at `timeout_s`.

    JAX's client aborts the process with a stack dump when it cannot connect; this check turns
    the commonest cause (a wrong address, a coordinator that never started) into one line.
    """
    host, _, port = spec.coordinator_address.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, remaining))):
                return
        except OSError as error:
            reason = error.strerror or type(error).__name__
        if remaining <= 0:
            raise JoinError(
                f"process {spec.process_id} of {spec.num_processes} could not reach the "
                f"coordinator at {spec.coordinator_address} within {timeout_s:g} s ({reason}); "
                "is process 0 running, and is the address one the others can reach?"
            )
        time.sleep(min(0.5, max(remaining, 0)))


def _id_ranges(ids: list[int]) -> str:
    ids = sorted(ids)
    if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1:
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


class PeerWatch:
    """Signs of life through the runtime's key-value store; a lost peer ends this process."""

    def __init__(self, spec: ProcessSpec, client, lost_after_s: float, interval_s: float = 1.0):
        self.spec, self.client = spec, client
        self.lost_after_s, self.interval_s = lost_after_s, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="t5scale-peers", daemon=True)

    @property
    def multi_process(self) -> bool:
        return self.spec.multi_process

    def start(self) -> None:
        self._thread.start()

    def _key(self, process: int) -> str:
        return f"{_KEY}{process}"

    def _run(self) -> None:
        me, count = self.spec.process_id, self.spec.num_processes
        last_seen = {p: (None, time.monotonic()) for p in range(count) if p != me}
        beat = 0
        while not self._stop.is_set():
            try:
                self.client.key_value_set(self._key(me), f"alive {beat}", allow_overwrite=True)
                values = dict(self.client.key_value_dir_get(_KEY))
            except Exception as error:  # noqa: BLE001  (the coordinator is unreachable)
                if self._stop.is_set():
                    return
                self._exit(0, f"the coordinator at {self.spec.coordinator_address} stopped "
                              f"answering ({' '.join(str(error).split())[:160]})")  # fmt: skip
            beat += 1
            now = time.monotonic()
            for peer, (value, since) in last_seen.items():
                current = values.get(self._key(peer))
                if current and current.startswith("failed"):
                    self._exit(peer, current.removeprefix("failed").strip(" :") or "it failed")
                if current == "done":
                    continue
                if current != value:
                    last_seen[peer] = (current, now)
                elif now - since > self.lost_after_s:
                    self._exit(
                        peer,
                        f"no sign of life for {self.lost_after_s:g} s "
                        "(killed, crashed, or its host is down)",
                    )
            self._stop.wait(self.interval_s)

    def _exit(self, peer: int, reason: str) -> None:
        role = " (the coordinator)" if peer == 0 else ""
        leave_now(  # JAX's shutdown would wait for the lost process
            f"t5scale: error: process {peer}{role} of {self.spec.num_processes} was lost: "
            f"{reason}; process {self.spec.process_id} stops",
            PROCESSES_FAILED,
        )

    def done(self) -> None:
        """This process finished normally: peers no longer expect signs of life from it."""
        if not self.multi_process:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.key_value_set(self._key(self.spec.process_id), "done", allow_overwrite=True)

    def fail(self, reason: str, exit_code: int) -> None:
        """Tell the peers why this process stops, then exit without JAX's shutdown barrier."""
        if not self.multi_process:
            return
        self._stop.set()
        try:
            self.client.key_value_set(
                self._key(self.spec.process_id),
                f"failed: {reason[:300]}",
                allow_overwrite=True,
            )
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)

    def wait_for_verdict(self) -> None:
        """After a collective failed: give the watch time to name the lost peer (it exits)."""
        if self.multi_process:
            self._stop.wait(self.lost_after_s + 3 * self.interval_s)


def all_reduce_check(mesh) -> tuple[float, float]:
    """(got, expected) of one all-reduce over every device of `mesh`: each adds its process id
    + 1, so that a process that is not there, or counted twice, shows."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ids = np.vectorize(lambda device: device.process_index + 1)(mesh.devices)
    values = jax.make_array_from_callback(
        ids.shape, NamedSharding(mesh, P(*mesh.axis_names)),
        lambda index: ids[index].astype(np.float32),
    )  # fmt: skip
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(values)
    # Every local device's part finished, not only the one `float` reads: XLA:CPU sums in steps
    # (inside a process, then across), so another device may still be in its cross-process
    # step, and a process that exits meanwhile left its peer stuck at exit, in gloo.
    total = jax.block_until_ready(total)
    return float(total), float(ids.sum())
