"""The device mesh: `replica` × `pipeline` × `zero` × `tensor`, every axis Auto (see
docs/concepts.md).

On several hosts the mesh is hybrid, as in ZeRO inside a node and replication across nodes:
`tensor` and `zero` stay inside a host and `replica` spans the hosts, so only the once-per-step
gradient reduction crosses the slow network. A host is a node, whether one process drives its
GPUs or one process drives each (Target.host_groups; on emulated CPU devices each process is a
host). With `zero_across_hosts=True` the `zero` axis spans the hosts instead (ZeRO over the
whole cluster: less memory per device, more inter-node traffic). Devices are ordered as
mesh_utils' hybrid device mesh orders them, hosts as the slow ("DCN") dimension.

On TPUs the slow network joins slices, not hosts: a slice's hosts share its ICI torus, so the
whole slice is one group (`zero` and `tensor` over ICI, laid along the torus by mesh_utils) and
`replica` (or, with zero_across_hosts, `zero`) spans the slices over DCN, as MaxText lays its
ICI and DCN axes.

`pipeline` splits the encoder's and the decoder's layer stacks into stages
(t5scale/train/pipeline.py); it is a model axis, so the batch is not split over it. Across hosts
it comes first: the stages span the hosts, and the axis across hosts the rest of them (TP
inside a node, PP across nodes, as NeMo and Megatron lay out T5).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from t5scale.errors import MeshError, check_field_types
from t5scale.parallel.zero import check_stages, with_pipeline
from t5scale.target import Target

AXES = ("replica", "pipeline", "zero", "tensor")
# The batch is split over both data-parallel axes; model state is only ever sharded over `zero`.
DATA_AXES = ("replica", "zero")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How training is spread: the ZeRO stage and the mesh shape.

    -1 for one axis: all remaining devices. replica=None: one replica per host (TPU slice)
    when replica is the axis across hosts, else 1. pipeline > 1: the layer stacks split into that
    many stages, TrainConfig.micro_batches of them in flight (t5scale/train/pipeline.py).
    """

    zero_stage: int = 0
    replica: int | None = None
    zero: int = -1
    tensor: int = 1
    zero_across_hosts: bool = False
    pipeline: int = 1

    def __post_init__(self) -> None:
        check_field_types(self)
        check_stages([self.zero_stage], "ParallelConfig.zero_stage")
        sizes = (self.replica, self.zero, self.tensor)
        if any(s is not None and (s == 0 or s < -1) for s in sizes) or sizes.count(-1) > 1:
            raise MeshError(
                f"mesh axes must be positive, with at most one -1; got {self.shape_str()}"
            )
        if self.pipeline < 1:
            raise MeshError(f"ParallelConfig.pipeline must be >= 1, got {self.pipeline}")
        if not with_pipeline([self.zero_stage], self.pipeline):
            raise MeshError(
                f"ZeRO stage {self.zero_stage} with pipeline={self.pipeline}: a pipeline "
                "accumulates each stage's gradients over every micro-batch inside its schedule, "
                "so stage 2 could not keep them scattered and stage 3 would gather every layer "
                "again for each micro-batch; use zero_stage 0 or 1 with a pipeline"
            )

    def shape_str(self) -> str:
        replica = "auto" if self.replica is None else self.replica
        pipeline = f" pipeline={self.pipeline}" if self.pipeline > 1 else ""
        return f"replica={replica}{pipeline} zero={self.zero} tensor={self.tensor}"

    @property
    def axis_across_hosts(self) -> str:
        return "zero" if self.zero_across_hosts else "replica"

    def resolve(self, num_devices: int, dcn_groups: int = 1) -> tuple[int, int, int, int]:
        """The concrete (replica, pipeline, zero, tensor) for `num_devices` over `dcn_groups`
        groups that only the slow network joins (hosts; TPU slices), or a MeshError that says
        why."""
        replica = self.replica
        hosts = dcn_groups
        if replica is None:
            pipelined_hosts = hosts // math.gcd(hosts, self.pipeline)
            replica = pipelined_hosts if self.axis_across_hosts == "replica" else 1
        sizes = [replica, self.pipeline, self.zero, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise MeshError(
                    f"mesh {self.shape_str()} does not divide {num_devices} devices "
                    f"({num_devices} is not a multiple of {known})"
                )
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            auto = f" (replica=auto: {replica} here)" if self.replica is None else ""
            raise MeshError(
                f"mesh {self.shape_str()} needs {math.prod(sizes)} devices, but {num_devices} "
                f"are there{auto}; give one axis -1 to take the rest"
            )
        replica, pipeline, zero, tensor = sizes
        if tensor > 1 and replica * zero == 1 and pipeline == 1:
            # XLA's SPMD partitioner rejects the step's gradient all-reduce over data axes of
            # one device for a tensor-split leaf ("Cross-partition allreduce must be in (partial)
            # manual partitioning mode", JAX 0.10.2): say so before it is compiled. With a
            # `pipeline` axis of 2 or more it compiles (TP × PP: tests/test_pipeline.py).
            raise MeshError(
                f"mesh {self.shape_str()}: tensor={tensor} over all {num_devices} devices leaves "
                "no data-parallel axis, which t5scale's step cannot compile (XLA's SPMD "
                "partitioner); give zero or replica at least 2 of the devices"
            )
        self.hosts_per_axis(tuple(sizes), hosts)  # a MeshError where they cannot span them
        return tuple(sizes)

    def hosts_per_axis(self, sizes: tuple[int, ...], hosts: int) -> tuple[int, ...]:
        """How many of the `hosts` each axis of a mesh of `sizes` spans: `pipeline` first (its
        permutes carry one micro-batch's activations, far less than a gradient reduction, as
        Megatron puts pipeline stages outermost), then the axis across hosts."""
        spans = [1] * len(AXES)
        left = hosts
        for axis in ("pipeline", self.axis_across_hosts):
            index = AXES.index(axis)
            take = math.gcd(left, sizes[index])
            spans[index], left = take, left // take
        if left != 1:
            across = sizes[AXES.index(self.axis_across_hosts)]
            pipeline = sizes[AXES.index("pipeline")]
            raise MeshError(
                f"{self.axis_across_hosts}={across} times pipeline={pipeline} spans the hosts and "
                f"must be a multiple of the {hosts} hosts (TPU slices, on a pod) "
                f"(ParallelConfig.zero_across_hosts={self.zero_across_hosts})"
            )
        return tuple(spans)


def make_mesh(config: ParallelConfig, devices: list | None = None) -> Mesh:
    """A mesh over `devices` (default: all), `tensor` fastest-varying so it stays within a host
    (a slice, on TPUs), laid along the TPU torus where the devices are TPUs."""
    devices = list(jax.devices() if devices is None else devices)
    target = Target.of(devices)
    groups, tpu = target.dcn_groups, target.is_tpu
    shape = config.resolve(len(devices), groups)
    auto = (AxisType.Auto,) * len(AXES)
    if groups > 1:
        dcn = config.hosts_per_axis(shape, groups)
        inside = tuple(s // d for s, d in zip(shape, dcn, strict=True))
        if tpu:  # slices, each laid along its torus
            grid = mesh_utils.create_hybrid_device_mesh(
                inside, dcn, devices, allow_split_physical_axes=True
            )
        else:
            hosts = target.host_groups()
            if len({len(host) for host in hosts}) > 1:
                counts = ", ".join(str(len(host)) for host in hosts)
                raise MeshError(f"the hosts hold different numbers of devices ({counts}): "
                                "a mesh needs the same on each")  # fmt: skip
            grid = hybrid_grid(inside, dcn, hosts)
        return Mesh(grid, AXES, axis_types=auto)
    if tpu:  # an axis may take part of a torus dimension (tensor=2 on a 4x4x4 slice)
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, AXES, axis_types=auto)
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, AXES, axis_types=auto)
    return Mesh(np.array(devices).reshape(shape), AXES, axis_types=auto)


def hybrid_grid(inside: tuple[int, ...], dcn: tuple[int, ...], hosts: list[list]) -> np.ndarray:
    """The devices of `hosts` (each host's in order) as a grid of shape inside × dcn, axis by
    axis: host h (in row-major order over `dcn`) holds the block at offsets h's index × inside.
    A host's processes (one per GPU) stay inside its block, so the axes inside it never cross
    the slow network. The same grid as mesh_utils' hybrid mesh where a host is one process."""
    blocks = np.empty((len(hosts), *inside), dtype=object)
    for index, devices in enumerate(hosts):
        blocks[index] = np.array(devices, dtype=object).reshape(inside)
    axes = len(inside)
    interleaved = [k for axis in range(axes) for k in (axis, axes + axis)]
    grid = blocks.reshape(*dcn, *inside).transpose(interleaved)
    return grid.reshape([d * i for d, i in zip(dcn, inside, strict=True)])


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in DATA_AXES)


def describe_mesh(mesh: Mesh, config: ParallelConfig) -> str:
    """One line: the shape, which axis spans processes, and what this process holds."""
    shape = " × ".join(
        f"{axis}={size}" for axis, size in mesh.shape.items() if axis != "pipeline" or size > 1
    )
    processes = len({d.process_index for d in mesh.devices.flat})
    if processes == 1:
        return f"mesh {shape} over {mesh.devices.size} devices"
    target = Target.of(list(mesh.devices.flat))
    groups, unit = target.dcn_groups, "slice" if target.is_tpu else "host"
    across = f"{config.axis_across_hosts} across {processes} processes"
    if groups != processes:  # processes sharing a host (one per GPU), or a TPU slice
        across = f"{processes} processes on {groups} {unit}{'s' if groups > 1 else ''}"
        across += f", {config.axis_across_hosts} across them" if groups > 1 else ""
    me = jax.process_index()
    mine = np.argwhere(np.vectorize(lambda d: d.process_index == me)(mesh.devices))
    held = ", ".join(
        f"{axis} {_span(mine[:, i])}" for i, axis in enumerate(AXES) if mesh.shape[axis] > 1
    )
    return f"mesh {shape} over {mesh.devices.size} devices, {across}; process {me} holds {held}"


def _span(indices: np.ndarray) -> str:
    low, high = int(indices.min()), int(indices.max())
    return str(low) if low == high else f"{low}-{high}"
