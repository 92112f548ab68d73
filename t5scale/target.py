"""What a program is compiled for: the one place that answers "which compiler, which platform".

    Target.local(8)                            the devices at hand (emulated CPU devices, or
                                               this host's GPUs): programs compile and run
    Target.compile_only_gpus(GpuTopology(...)) GPUs that are not here (t5scale/xla_gpu.py):
                                               XLA's GPU compiler makes the program; nothing runs
    Target.compile_only_tpus(TpuTopology(...)) TPU slices that are not here (t5scale/xla_tpu.py):
                                               XLA's TPU compiler (libtpu), deviceless
    Target.for_topology(topology)              either of the two, as the topology says

A target owns the devices a mesh is laid over, the groups among them that only the slow network
joins (the hosts its processes run on; TPU slices), the compiler's options, whether the persistent
compilation cache may hold its programs, the compiler's name as reports give it, and whether
t5scale's fused attention kernels compile for it. A plan, a simulation, a trial, a checkpoint
and a training run each ask their target (the hardware of a cluster file makes it:
t5scale/whatif/hardware.py); nothing else asks a device for its platform.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax

from t5scale import xla_gpu, xla_tpu
from t5scale.errors import ConfigError
from t5scale.jsonform import fields_from_json

# The host each process of this run is on, by process index: set once the processes have
# joined (t5scale/parallel/distributed.py), so that processes sharing a node (one per GPU) are
# one group of the mesh, not one each. Unset: every process is a host of its own.
_process_hosts: tuple[str, ...] = ()


def set_process_hosts(hosts: Sequence[str]) -> None:
    """Record the host of every process of this run (index: the process index)."""
    global _process_hosts
    _process_hosts = tuple(hosts)


def host_of(process_index: int) -> str:
    """The host a process of this run is on, as the processes said when they joined."""
    if process_index < len(_process_hosts):
        return _process_hosts[process_index]
    return f"process {process_index}"


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a program is compiled for, and whether it can run here."""

    devices: tuple[Any, ...]
    compile_only: bool = False

    @classmethod
    def local(cls, count: int | None = None) -> Target:
        """The first `count` devices at hand (default: all of them), across processes."""
        devices = jax.devices()
        if count is not None and count > len(devices):
            raise ConfigError(f"{count} devices asked, {len(devices)} here")
        return cls(tuple(devices[:count]))

    @classmethod
    def compile_only_gpus(cls, topology: xla_gpu.GpuTopology) -> Target:
        """`topology`'s GPUs, compiled for by XLA's GPU compiler without them."""
        return cls(tuple(topology.devices()), compile_only=True)

    @classmethod
    def compile_only_tpus(cls, topology: xla_tpu.TpuTopology) -> Target:
        """`topology`'s TPU chips, compiled for by XLA's TPU compiler without them."""
        return cls(tuple(topology.devices()), compile_only=True)

    @classmethod
    def for_topology(cls, topology: xla_gpu.GpuTopology | xla_tpu.TpuTopology) -> Target:
        """A topology's devices, compiled for by its own compiler (XLA:GPU or XLA:TPU)."""
        if isinstance(topology, xla_tpu.TpuTopology):
            return cls.compile_only_tpus(topology)
        return cls.compile_only_gpus(topology)

    @classmethod
    def of(cls, devices: Sequence[Any] | Target | None) -> Target:
        """A target from what a caller holds: a target, a list of devices, or None (all
        devices at hand)."""
        if isinstance(devices, Target):
            return devices
        if devices is None:
            return cls.local()
        devices = tuple(devices)
        compile_only = xla_gpu.is_compile_only_gpu(devices) or xla_tpu.is_compile_only_tpu(devices)
        return cls(devices, compile_only=compile_only)

    @property
    def platform(self) -> str:
        """'cpu', 'gpu' or 'tpu' (XLA's name, which says 'gpu' for CUDA devices)."""
        return self.devices[0].platform

    @property
    def is_gpu(self) -> bool:
        return self.platform == "gpu"

    @property
    def is_tpu(self) -> bool:
        return self.platform == "tpu"

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def dcn_groups(self) -> int:
        """Groups of devices only the slow network joins: the mesh's axis across them
        (t5scale/parallel/mesh.py). Hosts (GPU nodes, each with one process or one per GPU);
        TPU slices, whose hosts share ICI."""
        if self.is_tpu:
            return len({getattr(d, "slice_index", None) or 0 for d in self.devices})
        return len(self.host_groups())

    def host_groups(self) -> list[list[Any]]:
        """The devices by host, hosts in the order of their first process, devices as given.
        A compile-only GPU cluster's devices: a node per process index."""
        groups: dict[str, list[Any]] = {}
        for device in sorted(self.devices, key=lambda d: d.process_index):  # stable
            index = device.process_index
            host = f"process {index}" if self.compile_only else host_of(index)
            groups.setdefault(host, []).append(device)
        return list(groups.values())

    @property
    def runs_here(self) -> bool:
        return not self.compile_only

    @property
    def fused_kernels(self) -> bool:
        """Whether t5scale's Pallas attention kernels compile for it: Triton on GPUs, Mosaic on
        TPUs from v4 (Mosaic refuses a v2's bf16 matmuls: "Unsupported matmul RHS type")."""
        if self.is_tpu:
            return self.devices[0].device_kind not in _MOSAIC_REFUSES
        return self.is_gpu

    @property
    def strided_rolls(self) -> bool:
        """Whether Mosaic rolls each row of a TPU tile by a different amount (from v5: "only
        supported in TPU v5+"), which its attention kernels skew their bias tiles with."""
        return self.is_tpu and self.devices[0].device_kind not in _NO_STRIDED_ROLLS

    @property
    def compiler_name(self) -> str:
        """As plan and simulate report it: 'xla:cpu', 'xla:gpu <GPU>, N nodes x G', or
        'xla:tpu <chip>, <slice> (<torus>), N slices'."""
        if self.is_tpu:
            return xla_tpu.compiler_name(self.devices)
        return xla_gpu.compiler_name(self.devices)

    @property
    def compiler_options(self) -> dict[str, Any]:
        """XLA's options for a compile (compile-only GPUs: xla_gpu.compiler_options; compile-only
        TPUs: xla_tpu.COMPILER_OPTIONS)."""
        if not self.compile_only:
            return {}
        return (
            dict(xla_tpu.COMPILER_OPTIONS)
            if self.is_tpu
            else xla_gpu.compiler_options(self.devices)
        )

    @property
    def persistent_cache(self) -> bool:
        """Whether JAX's persistent compilation cache may keep its programs: a compile-only
        program written there cannot be read back without the device's client (JAX warns and
        compiles again), so it is not written."""
        return self.runs_here

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Around a compile for this target: its cache policy."""
        if self.persistent_cache:
            yield
            return
        with _not_written_to_the_persistent_cache():
            yield


def topology_from_json(data: Mapping[str, Any]) -> xla_gpu.GpuTopology | xla_tpu.TpuTopology:
    """A compile-only topology from its JSON form (a trial's spec): a TPU slice's or GPUs'."""
    kind = xla_tpu.TpuTopology if "slice" in data else xla_gpu.GpuTopology
    return fields_from_json(kind, data)


# TPU chips (device_kind) for which Mosaic does not compile t5scale's attention kernels, and
# those it compiles them for without strided rolls
_MOSAIC_REFUSES = frozenset({"TPU v2", "TPU v3"})
_NO_STRIDED_ROLLS = frozenset({"TPU v2", "TPU v3", "TPU v4"})


@contextlib.contextmanager
def _not_written_to_the_persistent_cache() -> Iterator[None]:
    # JAX decides once per process whether the cache is used at all, so a compile cannot turn
    # it off; what it reads per compile is the least compile time worth writing. The context
    # form of that setting is in jax's private config module; where a release lacks it, the
    # program is written and JAX compiles again where it cannot read it back.
    from jax._src import config as jax_config

    least_time = getattr(jax_config, "persistent_cache_min_compile_time_secs", None)
    if least_time is None or not callable(least_time):
        yield
        return
    with least_time(float("inf")):
        yield
