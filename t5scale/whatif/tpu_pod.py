"""A TPU pod as the planner sees it: one generation's chips, in slices over DCN. Each figure in
gin/clusters/tpu_*.gin names its source.

    t5scale plan --gin_file=gin/models/mt5_xxl.gin --gin_file=gin/clusters/tpu_v5p.gin \
        --gin.TpuPodConfig.slice="'v5p-128'" --gin.TpuPodConfig.slices=2

As with GPU clusters there are no defaults for the figures: a file that leaves one out is an
error. The slice is named as Cloud TPU names accelerator types (t5scale/xla_tpu.py).
"""

from __future__ import annotations

import dataclasses

from t5scale.errors import ConfigError, check_field_types
from t5scale.xla_tpu import GENERATIONS, TpuSlice, TpuTopology


@dataclasses.dataclass(frozen=True)
class TpuPodConfig:
    """Bandwidths in bytes/s, FLOP/s and memory per chip."""

    name: str
    generation: str  # a generation of t5scale/xla_tpu.py: 'v4', 'v5e', 'v5p', 'v6e'
    chips_per_host: int  # a TPU VM's chips
    device_memory_gb: float  # HBM per chip
    memory_bandwidth: float  # HBM per chip
    peak_flops: float  # dense bf16 per chip
    ici_link_bandwidth: float  # one ICI link, one direction
    ici_links_per_chip: int  # the torus's neighbours: 4 in 2D, 6 in 3D
    dcn_bandwidth_per_host: float  # a host's data-centre network, one direction
    slice: str = ""  # the accelerator type, 'v5p-128'; '' where none is chosen yet
    slice_shape: str | None = None  # its torus, '4x4x8'; None: Cloud TPU's for its chips
    slices: int = 1  # slices over DCN

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.generation not in GENERATIONS:
            raise ConfigError(f"TpuPodConfig.generation must be one of {', '.join(GENERATIONS)}, "
                              f"got {self.generation!r}")  # fmt: skip
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int | float) and value <= 0:
                raise ConfigError(f"TpuPodConfig.{field.name} must be > 0, got {value!r}")
        if self.slice:
            self.topology()  # a slice the generation does not have is refused now

    def topology(self, devices: int | None = None) -> TpuTopology:
        """The slices to compile for: the pod's own, or (`devices`: the study's device counts)
        `slices` slices of this generation holding that many devices in all, each in Cloud
        TPU's shape for its chips (a ConfigError where Cloud TPU has no such slice)."""
        if devices is not None:
            spec = GENERATIONS[self.generation]
            chips, odd = divmod(devices, self.slices * spec.devices_per_chip)
            if odd or not chips:
                raise ConfigError(f"{devices} devices are not {self.slices} whole {self.generation} "
                                  "slices")  # fmt: skip
            name = f"{self.generation}-{chips * spec.cores_per_chip_in_name}"
            return TpuTopology(TpuSlice.named(name), self.slices)
        if not self.slice:
            raise ConfigError(f"TpuPodConfig {self.name!r}: no slice chosen (e.g. "
                              f"--gin.TpuPodConfig.slice=\"'{self.generation}-8'\")")  # fmt: skip
        one = TpuSlice.named(self.slice, self.slice_shape)
        if one.generation != self.generation:
            raise ConfigError(f"TpuPodConfig.slice {self.slice!r} is not a {self.generation} "
                              f"slice ({self.name})")  # fmt: skip
        return TpuTopology(one, self.slices)
