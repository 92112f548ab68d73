"""A GPU cluster as the what-if wing sees it (one kind of whatif/hardware.py's Hardware): its
figures, each named by its source in gin/clusters/*.gin, and its answers.

There are no defaults: a cluster file that leaves a figure out is an error, not an A100. Its
GPU's peak FLOP/s are the datasheet's, from the one table of them (t5scale/analysis/peaks.py),
unless the file gives its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import jax

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.analysis.peaks import GPU_DATASHEET
from t5scale.analysis.records import StepAnalysis
from t5scale.errors import ConfigError, check_field_types
from t5scale.model.sizes import ModelConfig
from t5scale.startup import cuda_plugin_installed
from t5scale.target import Target
from t5scale.whatif.step_time import StepTimePrediction, predict, predict_from_program
from t5scale.xla_gpu import GpuTopology, require_plugin, target_names

if TYPE_CHECKING:
    from t5scale.train.config import RunConfig
    from t5scale.whatif.program_time import ProgramTime
    from t5scale.whatif.simulate import SimulateConfig

EFFICIENCIES = ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "roofline_fraction",
                "gemm_efficiency_float8")  # fmt: skip
NAMES = ("name", "gpu", "gpu_target")
PEAKS = {"peak_flops": "bfloat16", "peak_flops_float32": "float32", "peak_flops_float8": "float8"}
OPTIONAL = ("peak_flops_float8",)  # None on a GPU without FP8 tensor cores


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Bandwidths in bytes/s, latencies in seconds, FLOP/s per GPU.

    Bus bandwidths are nccl-tests' `busbw` for a large all-reduce (what the link achieves, with
    the algorithm's (n-1)/n factors taken out): `nvlink_bus_bandwidth` among one node's GPUs,
    `network_bus_bandwidth` across nodes with all of a node's NICs in use (rail-aligned rings).
    """

    name: str
    gpu: str  # a GPU of t5scale/analysis/peaks.py's GPU_DATASHEET, e.g. 'NVIDIA H100' (SXM)
    gpus_per_node: int
    gemm_efficiency: float  # fraction of the peak that large GEMMs reach
    # Fraction of the peak that fused attention kernels reach, FLOPs counted as the kernel
    # inventory counts them (t5scale/analysis/kernels.py): measured on the card by
    # bench/gpu_check.py's kernel item, about a seventh of the GEMMs' (docs/gpu_check.md).
    attention_efficiency: float
    memory_bandwidth: float  # HBM, datasheet
    memory_efficiency: float  # fraction of it that streaming kernels reach
    # Fraction of that roofline a compiled t5scale step reaches (launch gaps, layout copies,
    # fusions XLA does not make): the CPU path's one calibrated figure, fitted on t5scale's own
    # one-GPU steps (bench/cluster_model_vs_published.py --calibrate), never on the validation
    # rows. The GPU path times those kernels themselves and applies none (gpu_step.py).
    roofline_fraction: float
    device_memory_gb: float
    nvlink_bus_bandwidth: float
    network_bus_bandwidth: float
    nvlink_latency_s: float  # one ring step inside a node
    network_latency_s: float  # one ring (or tree) step between nodes
    collective_launch_s: float  # fixed cost of one collective
    # dense 16-bit, TF32 (fp32 compute) and FP8 tensor cores; None: the GPU's datasheet figure
    # (for FP8 none where the GPU has no FP8 tensor cores)
    peak_flops: float | None = None
    peak_flops_float32: float | None = None
    peak_flops_float8: float | None = None
    # Fraction of the FP8 peak that large FP8 GEMMs reach. None: gemm_efficiency, an assumption
    # until the GPU check times an FP8 step (issue 62): no FP8 GEMM has been measured here.
    gemm_efficiency_float8: float | None = None
    # XLA's description of the GPU to compile for without it: a name in t5scale/gpu_targets/
    # ('h100_sxm') or a GpuTargetConfig file (t5scale/xla_gpu.py). None: no GPU compiles.
    gpu_target: str | None = None

    device_word: ClassVar[str] = "GPU"
    group_word: ClassVar[str] = "node"

    def __post_init__(self) -> None:
        check_field_types(self)  # gpus_per_node=8.0 or a bare word is not a figure
        if self.gpu not in GPU_DATASHEET:
            raise ConfigError(f"ClusterConfig.gpu must be one of {', '.join(GPU_DATASHEET)}, "
                              f"got {self.gpu!r}")  # fmt: skip
        for name, dtype in PEAKS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, GPU_DATASHEET[self.gpu].get(dtype))
        if self.gemm_efficiency_float8 is None:
            object.__setattr__(self, "gemm_efficiency_float8", self.gemm_efficiency)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in NAMES or (field.name in OPTIONAL and value is None):
                continue
            if field.name == "gpus_per_node" and value < 1:
                raise ConfigError(f"ClusterConfig.gpus_per_node must be >= 1, got {value!r}")
            if field.name in EFFICIENCIES and not 0 < value <= 1:
                raise ConfigError(f"ClusterConfig.{field.name} must be in (0, 1], got {value!r}")
            if value < 0 or (value == 0 and not field.name.endswith("_s")):
                raise ConfigError(f"ClusterConfig.{field.name} must be > 0, got {value!r}")

    def topology(self, gpus: int) -> GpuTopology:
        """`gpus` GPUs of this cluster to compile for: whole nodes, or part of one."""
        if self.gpu_target is None:
            raise ConfigError(f"ClusterConfig {self.name!r} names no gpu_target (a GPU of "
                              f"t5scale/gpu_targets/: {', '.join(target_names())})")  # fmt: skip
        per_node = min(gpus, self.gpus_per_node)
        if gpus % per_node:
            raise ConfigError(f"{gpus} GPUs are not whole nodes of {self.gpus_per_node}")
        return GpuTopology(self.gpu_target, gpus // per_node, per_node)

    # ---- what every hardware answers (whatif/hardware.py) ----

    @property
    def memory_budget_bytes(self) -> int:
        return int(self.device_memory_gb * 1e9)

    def target(self, devices: int, compiler: str = "gpu") -> Target:
        """`devices` of the cluster's GPUs: compiler 'gpu', XLA's GPU compiler for them (its
        gpu_target; a ConfigError naming the install where jax's CUDA plugin is missing);
        'cpu', that many emulated CPU devices; 'auto', the GPU compiler where the cluster names
        a target and the plugin is installed."""
        if compiler == "auto":
            usable = self.gpu_target is not None and cuda_plugin_installed()
            compiler = "gpu" if usable else "cpu"
        if compiler == "cpu":
            if jax.device_count() < devices:
                raise ConfigError(f"{devices} devices to emulate, {jax.device_count()} here")
            return Target.local(devices)
        topology = self.topology(devices)  # a ConfigError where the cluster names no target
        require_plugin()
        return Target.compile_only_gpus(topology)

    def named_target(self) -> Target | None:
        return None  # a cluster file names no GPU count

    def group_target(self, groups: int, compiler: str = "gpu") -> Target:
        return self.target(groups * self.gpus_per_node, compiler)

    def group_words(self, groups: int) -> str:
        return f"{groups} node{'s' * (groups > 1)}"

    def dcn_groups(self, devices: int) -> int:
        return self.topology(devices).nodes

    def emulated_devices(self, groups: int) -> int:
        return groups * self.gpus_per_node  # the CPU path compiles for that many

    def check_simulation(self, run: RunConfig, config: SimulateConfig) -> None:
        if self.gpus_per_node % config.tensor:  # tensor groups live inside a node
            raise ConfigError(f"SimulateConfig.tensor={config.tensor} must divide "
                              f"ClusterConfig.gpus_per_node={self.gpus_per_node}")  # fmt: skip

    def timing_path(self, target: Target) -> str:
        return "gpu" if target.is_gpu else "cpu"

    def predict(
        self, analysis: StepAnalysis, model: ModelConfig, devices: Sequence[Any],
        config: SimulateConfig,
    ) -> tuple[StepTimePrediction, ProgramTime | None]:  # fmt: skip
        """A GPU program timed kernel by kernel (step_time.predict_from_program); a CPU
        program's step with XLA:GPU's combining and overlap assumed (step_time.predict)."""
        if analysis.program is not None:
            return predict_from_program(analysis, model, self, overlap=config.overlap), None
        threshold = config.combine_threshold_bytes
        return predict(analysis, model, self, config.overlap, threshold), None

    def link_seconds(
        self, ops: Sequence[CollectiveOp], devices: Sequence[Any]
    ) -> dict[str, float] | None:
        return None  # plan leaves NCCL's time to simulate

    def describe(self, config: SimulateConfig) -> str:
        fp8 = ""
        if self.peak_flops_float8:
            efficiency = self.gemm_efficiency_float8 or self.gemm_efficiency
            fp8 = f" (FP8 GEMMs: {self.peak_flops_float8 / 1e12:g} at {efficiency:.0%})"
        return (
            f"{self.name} nodes ({self.gpus_per_node} GPUs each; "
            f"{self.peak_flops / 1e12:g} TFLOP/s peak, GEMMs at {self.gemm_efficiency:.0%}{fp8}; "
            f"bus bandwidth NVLink {self.nvlink_bus_bandwidth / 1e9:g} GB/s, network "
            f"{self.network_bus_bandwidth / 1e9:g} GB/s per node; overlap "
            f"{'from the step' if config.overlap else 'off'}); micro-batch "
            f"{config.micro_batch_size} per GPU"
        )

    def compile_only_words(self) -> str:
        return f"XLA's GPU compiler for {self.name}'s GPUs ({self.gpu_target})"
