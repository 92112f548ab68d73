"""A TPU pod as the what-if wing sees it (one kind of whatif/hardware.py's Hardware): one
generation's chips, in slices over DCN; its figures, each named by its source in
gin/clusters/tpu_*.gin, and its answers.

    t5scale plan --gin_file=gin/models/mt5_xxl.gin --gin_file=gin/clusters/tpu_v5p.gin \
        --gin.TpuPodConfig.slice="'v5p-128'" --gin.TpuPodConfig.slices=2

As with GPU clusters there are no defaults for the figures: a file that leaves one out is an
error. The slice is named as Cloud TPU names accelerator types (t5scale/xla_tpu.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.analysis.records import StepAnalysis
from t5scale.errors import ConfigError, check_field_types
from t5scale.model.sizes import ModelConfig
from t5scale.target import Target
from t5scale.whatif.ici_dcn import dcn_op_seconds, op_seconds
from t5scale.whatif.program_time import ProgramTime
from t5scale.whatif.step_time import StepTimePrediction, prediction_of
from t5scale.whatif.tpu_step import predict_tpu_program
from t5scale.xla_tpu import GENERATIONS, TpuSlice, TpuTopology, require_libtpu

if TYPE_CHECKING:
    from t5scale.train.config import RunConfig
    from t5scale.whatif.simulate import SimulateConfig


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

    device_word: ClassVar[str] = "chip"
    group_word: ClassVar[str] = "slice"

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

    # ---- what every hardware answers (whatif/hardware.py) ----

    @property
    def memory_budget_bytes(self) -> int:
        return int(self.device_memory_gb * 1e9)

    def target(self, devices: int, compiler: str = "tpu") -> Target:
        """`devices` chips in `slices` slices of Cloud TPU's shape, for XLA:TPU."""
        return _compile_only(self.topology(devices))

    def named_target(self) -> Target | None:
        """The pod's own slices, where a slice is chosen."""
        return _compile_only(self.topology()) if self.slice else None

    def group_target(self, groups: int, compiler: str = "tpu") -> Target:
        """`groups` slices of the pod's slice."""
        return _compile_only(TpuTopology(self.topology().slice, groups))

    def group_words(self, groups: int) -> str:
        return f"{groups} × {self.slice}"

    def dcn_groups(self, devices: int) -> int:
        return self.slices

    def emulated_devices(self, groups: int) -> int:
        return 1  # XLA:TPU compiles for the pod's chips

    def check_simulation(self, run: RunConfig, config: SimulateConfig) -> None:
        if config.compiler != "auto":  # XLA:TPU makes a pod's programs
            raise ConfigError(f"SimulateConfig.compiler={config.compiler!r} applies to GPU "
                              "clusters; a TPU pod's programs are XLA:TPU's")  # fmt: skip
        if config.diloco_every:
            raise ConfigError("SimulateConfig.diloco_every: simulate times DiLoCo on GPU "
                              "clusters only so far")  # fmt: skip
        if run.model.dtype != "bfloat16":
            raise ConfigError("simulate on a TPU pod times bf16 compute (ModelConfig.dtype="
                              "'bfloat16'; the chips' peak is bf16's)")  # fmt: skip
        self.topology()  # a ConfigError before any compile where no slice is chosen

    def timing_path(self, target: Target) -> str:
        return "tpu"

    def predict(
        self, analysis: StepAnalysis, model: ModelConfig, devices: Sequence[Any],
        config: SimulateConfig,
    ) -> tuple[StepTimePrediction, ProgramTime]:  # fmt: skip
        """Its program's operations and collectives over ICI and DCN (tpu_step.py)."""
        timed = predict_tpu_program(analysis.program, self, self._topology_of(devices), devices)
        exposed = timed.exposed_communication_s if config.overlap else timed.communication_s
        prediction = prediction_of(
            analysis, self.peak_flops, self.device_memory_gb, timed.compute_s,
            timed.communication_s, exposed, timed.communication_by_kind_s,
        )  # fmt: skip
        return prediction, timed

    def _topology_of(self, devices: Sequence[Any]) -> TpuTopology:
        """The slices `devices` (compile-only chips of this pod) make up: the pod's own slice
        where they are whole ones of it, else Cloud TPU's shape for their chips."""
        slices = Target.of(devices).dcn_groups
        if self.slice:
            own = TpuTopology(self.topology().slice, slices)
            if own.size == len(devices):
                return own
        return dataclasses.replace(self, slices=slices).topology(len(devices))

    def link_seconds(
        self, ops: Sequence[CollectiveOp], devices: Sequence[Any]
    ) -> dict[str, float] | None:
        """Over each slice's ICI torus and between slices over DCN (ici_dcn.py)."""
        topology = self._topology_of(devices)
        per_chip = self.dcn_bandwidth_per_host / self.chips_per_host
        ici = dcn = 0.0
        for op in ops:
            ici += op_seconds(op, devices, topology.slice, self.ici_link_bandwidth) or 0.0
            dcn += dcn_op_seconds(op, topology.slices, per_chip) or 0.0
        return {"ICI": ici, "DCN": dcn}

    def describe(self, config: SimulateConfig) -> str:
        return (
            f"{self.name} ({self.slice}; {self.peak_flops / 1e12:g} TFLOP/s bf16 and "
            f"{self.memory_bandwidth / 1e9:g} GB/s of HBM a chip; ICI "
            f"{self.ici_link_bandwidth / 1e9:g} GB/s a link one way; DCN "
            f"{self.dcn_bandwidth_per_host / 1e9:g} GB/s a host; overlap "
            f"{'from the step' if config.overlap else 'off'}); micro-batch "
            f"{config.micro_batch_size} per chip"
        )

    def compile_only_words(self) -> str:
        slices = f"{self.slices} slice" + "s" * (self.slices > 1)
        return f"XLA's TPU compiler for {self.name}'s chips ({self.generation}, {slices})"


def _compile_only(topology: TpuTopology) -> Target:
    require_libtpu()  # a ConfigError naming the install, before libtpu is asked
    return Target.compile_only_tpus(topology)
