"""A GPU cluster as the cluster model sees it. Each figure in gin/clusters/*.gin names its source.

There are no defaults: a cluster file that leaves a figure out is an error, not an A100. Its
GPU's peak FLOP/s are the datasheet's, from the one table of them (t5scale/analysis/peaks.py),
unless the file gives its own.
"""

from __future__ import annotations

import dataclasses

from t5scale.analysis.peaks import GPU_DATASHEET
from t5scale.errors import ConfigError, check_field_types
from t5scale.xla_gpu import GpuTopology, target_names

EFFICIENCIES = ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "roofline_fraction")
NAMES = ("name", "gpu", "compile_target")
PEAKS = {"peak_flops": "bfloat16", "peak_flops_float32": "float32"}


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
    # dense 16-bit and TF32 (fp32 compute) tensor cores; None: the GPU's datasheet figure
    peak_flops: float | None = None
    peak_flops_float32: float | None = None
    # XLA's description of the GPU to compile for without it: a name in t5scale/gpu_targets/
    # ('h100_sxm') or a GpuTargetConfig file (t5scale/xla_gpu.py). None: no GPU compiles.
    compile_target: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self)  # gpus_per_node=8.0 or a bare word is not a figure
        if self.gpu not in GPU_DATASHEET:
            raise ConfigError(f"ClusterConfig.gpu must be one of {', '.join(GPU_DATASHEET)}, "
                              f"got {self.gpu!r}")  # fmt: skip
        for name, dtype in PEAKS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, GPU_DATASHEET[self.gpu][dtype])
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in NAMES:
                continue
            if field.name == "gpus_per_node" and value < 1:
                raise ConfigError(f"ClusterConfig.gpus_per_node must be >= 1, got {value!r}")
            if field.name in EFFICIENCIES and not 0 < value <= 1:
                raise ConfigError(f"ClusterConfig.{field.name} must be in (0, 1], got {value!r}")
            if value < 0 or (value == 0 and not field.name.endswith("_s")):
                raise ConfigError(f"ClusterConfig.{field.name} must be > 0, got {value!r}")

    def topology(self, gpus: int) -> GpuTopology:
        """`gpus` GPUs of this cluster to compile for: whole nodes, or part of one."""
        if self.compile_target is None:
            raise ConfigError(f"ClusterConfig {self.name!r} names no compile_target (a GPU of "
                              f"t5scale/gpu_targets/: {', '.join(target_names())})")  # fmt: skip
        per_node = min(gpus, self.gpus_per_node)
        if gpus % per_node:
            raise ConfigError(f"{gpus} GPUs are not whole nodes of {self.gpus_per_node}")
        return GpuTopology(self.compile_target, gpus // per_node, per_node)
