"""The device mesh: `replica` × `zero` × `tensor`, every axis Auto (see docs/concepts.md)."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("replica", "zero", "tensor")
# The batch is split over both data-parallel axes; model state is only ever sharded over `zero`.
DATA_AXES = ("replica", "zero")


class MeshError(ValueError):
    """A mesh shape that does not fit the devices."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How training is spread: the ZeRO stage and the mesh shape (-1: all remaining devices)."""

    zero_stage: int = 0
    replica: int = 1
    zero: int = -1
    tensor: int = 1

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        sizes = (self.replica, self.zero, self.tensor)
        if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
            raise MeshError(
                f"mesh axes must be positive, with at most one -1; got {self.shape_str()}"
            )

    def shape_str(self) -> str:
        return f"replica={self.replica} zero={self.zero} tensor={self.tensor}"

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """The concrete (replica, zero, tensor) for `num_devices`, or a MeshError that says why."""
        sizes = [self.replica, self.zero, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise MeshError(
                    f"mesh {self.shape_str()} does not divide {num_devices} devices "
                    f"({num_devices} is not a multiple of {known})"
                )
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise MeshError(
                f"mesh {self.shape_str()} needs {math.prod(sizes)} devices, but {num_devices} are there"
            )
        return tuple(sizes)


def make_mesh(config: ParallelConfig, devices: list | None = None) -> Mesh:
    """A mesh over `devices` (default: all), `tensor` fastest-varying so it stays within a host."""
    devices = list(jax.devices() if devices is None else devices)
    shape = config.resolve(len(devices))
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return Mesh(np.array(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in DATA_AXES)
