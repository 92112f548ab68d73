"""Compiling for TPU slices that are not here: XLA's TPU compiler (libtpu), deviceless.

    TpuTopology(TpuSlice.named("v5p-128"), slices=2).devices()   # 2 × 64 compile-only chips

libtpu (the `tpu` extra: jax[tpu] at the pinned jax) holds XLA's TPU compiler; on a TPU VM it is
also the runtime. `jax.experimental.topologies` describes a slice from its generation and torus
shape ("v5p:4x4x4") with no TPU present, and a program compiles for those devices as for real
ones: what the planner needs (memory per chip, the program's collectives), with nothing run.

Slices are named as Cloud TPU names accelerator types: v4 and v5p count TensorCores (two per
chip, run as one "megacore" device), v5e and v6e count chips. A slice's shape is Cloud TPU's
for that many chips (3D tori for v4 and v5p, 2D for v5e and v6e) unless given.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sys

import jax

from t5scale.errors import ConfigError
from t5scale.startup import captured_stderr, libtpu_installed, tpu_chips_present

INSTALL_HINT = "pip install 't5scale[tpu]' (jax[tpu]: libtpu, XLA's TPU compiler; Linux only)"
# A compile for chips that are not here: XLA:TPU refuses a program whose memory exceeds the
# chip's HBM (RESOURCE_EXHAUSTED); told not to, it makes the program, whose memory analysis then
# says by how much it does not fit (the planner's question). The program never runs.
COMPILER_OPTIONS = {"xla_tpu_no_crash_on_oom": True}


@dataclasses.dataclass(frozen=True)
class Generation:
    """What names and shapes a TPU generation's slices."""

    device_kind: str  # as XLA's devices say it
    topology_prefix: str  # the generation in libtpu's topology names ("v5p:2x2x2")
    chip_config: str  # "megacore": one device per chip of two TensorCores
    cores_per_chip_in_name: int  # v5p-8 is 4 chips: the name counts TensorCores
    dims: int  # the torus's dimensions
    devices_per_chip: int = 1  # 2 where each TensorCore is a device of its own (v2)


GENERATIONS = {
    # Colab's older TPU runtime (v2-8): each of a chip's two TensorCores is a JAX device.
    "v2": Generation("TPU v2", "v2", "default", 2, 2, devices_per_chip=2),
    "v4": Generation("TPU v4", "v4", "megacore", 2, 3),
    "v5p": Generation("TPU v5", "v5p", "megacore", 2, 3),
    "v5e": Generation("TPU v5 lite", "v5e", "default", 1, 2),
    "v6e": Generation("TPU v6 lite", "v6e", "default", 1, 2),
}

# Cloud TPU's slice shapes by chip count (its accelerator-type tables): 3D slices grow one
# dimension at a time from 2x2x1; 2D slices from 1x1 to the 16x16 pod.
_SHAPES_3D = {
    4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
    256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16),
}  # fmt: skip
_SHAPES_2D = {
    1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
    256: (16, 16),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """One slice: a TPU generation's chips on one ICI torus of `shape`."""

    generation: str  # a key of GENERATIONS
    shape: tuple[int, ...]

    @classmethod
    def named(cls, accelerator_type: str, shape: str | None = None) -> TpuSlice:
        """The slice Cloud TPU calls `accelerator_type` ('v5p-128', 'v5e-256', 'v4-8'), in
        `shape` ('4x4x8') or Cloud TPU's shape for its chips."""
        match = re.fullmatch(r"(v\d+[a-z]*|v5litepod)-(\d+)", accelerator_type)
        generation = "v5e" if match and match[1] == "v5litepod" else match and match[1]
        if not match or generation not in GENERATIONS:
            raise ConfigError(
                f"TPU slice {accelerator_type!r}: not an accelerator type of "
                f"{', '.join(GENERATIONS)} (e.g. 'v5p-128', 'v5e-256')"
            )
        spec = GENERATIONS[generation]
        count = int(match[2])
        chips, odd = divmod(count, spec.cores_per_chip_in_name)
        if shape is None:
            dims = _shapes(spec).get(chips)
        elif re.fullmatch(r"\d+(x\d+)*", shape.lower()):
            dims = tuple(int(n) for n in shape.lower().split("x"))
        else:
            dims = None  # not a shape: said below
        if odd or dims is None or len(dims) != spec.dims or math.prod(dims) != chips:
            raise ConfigError(
                f"TPU slice {accelerator_type!r}{f' {shape}' if shape else ''}: not a "
                f"{spec.dims}D slice of {generation}'s (its chips: "
                f"{', '.join(str(n * spec.cores_per_chip_in_name) for n in _shapes(spec))})"
            )
        return cls(generation, dims)

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        """Cloud TPU's accelerator type: 'v5p-128'."""
        return (
            f"{self.generation}-{self.chips * GENERATIONS[self.generation].cores_per_chip_in_name}"
        )

    @property
    def shape_text(self) -> str:
        return "x".join(str(n) for n in self.shape)

    @property
    def wraparound(self) -> tuple[bool, ...]:
        """Whether each axis of the torus closes into a ring (the jax-ml scaling book, "How to
        Think About TPUs"; MaxText's accelerator map agrees): a 3D slice (v4, v5p) wraps on
        every axis where it is whole 4x4x4 cubes (4x4x4, 4x4x8; not 2x2x4 or 2x4x4); a 2D
        slice (v5e, v6e) on each axis of the pod's 16 (8x16 on its long axis only)."""
        if len(self.shape) == 3:
            cubes = all(n % 4 == 0 for n in self.shape)
            return (cubes,) * 3
        return tuple(n == 16 for n in self.shape)


def _shapes(spec: Generation) -> dict:
    return _SHAPES_3D if spec.dims == 3 else _SHAPES_2D


@dataclasses.dataclass(frozen=True)
class TpuTopology:
    """`slices` slices of one shape over DCN, to compile for."""

    slice: TpuSlice
    slices: int = 1

    def __post_init__(self) -> None:
        if self.slices < 1:
            raise ConfigError(f"a TPU topology needs >= 1 slice, got {self.slices}")

    @property
    def size(self) -> int:
        """Devices: chips, or TensorCores where each is a device (v2)."""
        spec = GENERATIONS[self.slice.generation]
        return self.slice.chips * spec.devices_per_chip * self.slices

    def devices(self) -> list:
        """The compile-only chips, slice by slice (each with its `slice_index` where there are
        several) and, inside a slice, host by host as libtpu places them."""
        spec = GENERATIONS[self.slice.generation]
        name = f"{spec.topology_prefix}:{self.slice.shape_text}"
        # A TPU VM holds 2x2 chips; a slice of fewer (v5e-1) is a host of its own shape.
        shape = (*self.slice.shape, 1, 1)[:3]
        host = shape if self.slice.chips < 4 else None
        return list(_topology(name, spec.chip_config, self.slices, host).devices)


def require_libtpu() -> None:
    """A ConfigError that names the install command where libtpu is missing."""
    if not libtpu_installed():
        raise ConfigError(f"compiling for TPUs needs libtpu: {INSTALL_HINT}")


# What libtpu prints when it starts on a machine with no TPU (it looks for the TPU VM's
# accelerator type and worker hostnames, which a compile-only topology does not need).
_NO_TPU_LINES = (
    "could not determine TPU",
    "Logging before InitGoogle()",
    "libtpu_init_utils.cc",
    "Source Location Trace",
    "common_lib.cc",
)


@functools.cache
def _topology(name: str, chip_config: str, slices: int, host: tuple[int, ...] | None):
    require_libtpu()
    from jax.experimental import topologies

    if not tpu_chips_present():  # libtpu takes a lock a second process would wait on in vain
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    with captured_stderr() as said:
        try:
            bounds = {} if host is None else {"chips_per_host_bounds": host}
            topology = topologies.get_topology_desc(
                topology_name=name, platform="tpu", chip_config_name=chip_config,
                num_slices=slices, **bounds,
            )  # fmt: skip
        except jax.errors.JaxRuntimeError as error:
            topology, failure = None, error
    sys.stderr.writelines(line for line in said if not any(s in line for s in _NO_TPU_LINES))
    if topology is None:
        raise ConfigError(f"libtpu cannot describe TPU topology {name!r}: "
                          f"{str(failure).splitlines()[0]}")  # fmt: skip
    return topology


def is_compile_only_tpu(devices) -> bool:
    """Whether `devices` are compile-only TPU chips (no backend of this process has them)."""
    device = next(iter(devices))
    return device.platform == "tpu" and device not in jax.devices()


def generation_of(device) -> str:
    """'v5p' for a TPU v5 chip, from XLA's device kind."""
    kinds = {spec.device_kind: name for name, spec in GENERATIONS.items()}
    if device.device_kind not in kinds:
        raise ConfigError(f"TPU device kind {device.device_kind!r} is not one of "
                          f"{', '.join(kinds)}")  # fmt: skip
    return kinds[device.device_kind]


def compiler_name(devices) -> str:
    """'xla:tpu TPU v5, v5p-128 (4x4x4), 2 slices': the chips' kind, one slice's accelerator
    type and torus (from the chips' coordinates), and the slices."""
    devices = list(devices)
    slices = len({getattr(d, "slice_index", None) or 0 for d in devices})
    one = [d for d in devices if (getattr(d, "slice_index", None) or 0) == 0]
    shape = tuple(max(d.coords[i] for d in one) + 1 for i in range(len(one[0].coords)))
    spec = GENERATIONS[generation_of(devices[0])]
    chips = len(one) // spec.devices_per_chip
    torus = shape[: spec.dims] if math.prod(shape[: spec.dims]) == chips else shape
    name = TpuSlice(generation_of(devices[0]), torus).name
    many = f", {slices} slices" if slices > 1 else ""
    return f"xla:tpu {devices[0].device_kind}, {name} ({'x'.join(map(str, torus))}){many}"
