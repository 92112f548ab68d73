"""The figures the cost models read, as protocols: gpu_cluster.py's ClusterConfig and
tpu_pod.py's TpuPodConfig hold them (each field named by its source in gin/clusters/) and
answer for their kind of hardware with the cost models, which therefore need nothing of those
modules.
"""

from __future__ import annotations

from typing import Protocol


class GpuFigures(Protocol):
    """What NCCL's collectives (nccl.py) and a GPU's kernels (compute.py, gpu_step.py,
    step_time.py) cost on a GPU cluster: bandwidths in bytes/s, latencies in s, FLOP/s."""

    gpus_per_node: int
    peak_flops: float
    peak_flops_float32: float
    peak_flops_float8: float | None  # None: no FP8 tensor cores
    gemm_efficiency: float
    gemm_efficiency_float8: float
    attention_efficiency: float
    memory_bandwidth: float
    memory_efficiency: float
    roofline_fraction: float
    device_memory_gb: float
    nvlink_bus_bandwidth: float
    network_bus_bandwidth: float
    nvlink_latency_s: float
    network_latency_s: float
    collective_launch_s: float


class TpuFigures(Protocol):
    """What a TPU chip's operations and its ICI and DCN transfers cost (tpu_step.py)."""

    chips_per_host: int
    peak_flops: float
    memory_bandwidth: float
    ici_link_bandwidth: float
    dcn_bandwidth_per_host: float
