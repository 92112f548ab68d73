"""Seconds per step on a GPU cluster from the program XLA compiled for it (kernels.py's
Program): the GPU path, where step_time.py's CPU path has to assume what XLA:GPU combines
and overlaps.

- compute: each kernel runs at the slower of its FLOPs at the achieved GEMM rate (peak ×
  gemm_efficiency; the 16-bit peak, `peak_flops_float32` for f32 operands, or for 8-bit float
  operands `peak_flops_float8` × `gemm_efficiency_float8`; fused attention
  at peak × attention_efficiency, as measured on the card) and its bytes
  read and written at the achieved bandwidth (memory_bandwidth × memory_efficiency), plus one
  launch (KERNEL_LAUNCH_S). `fit_factor`, the share of that roofline a compiled step reaches,
  divides the roofline part, not the launches: 1 for the bare roofline, or a figure fitted on
  measured GPU steps;
- communication: each collective as XLA combined it, timed by nccl.py on the nodes its
  replica group spans (device i on node i // gpus_per_node, processes slowest);
- overlap, from the schedule: an asynchronous collective hides behind the kernels scheduled
  between its start and done, up to their time; the rest of it, and every synchronous one, is
  exposed.

step = compute + exposed communication; the optimizer update is among the kernels. Not
modelled: kernels slowed by a collective sharing the GPU's SMs and memory, collectives in
flight at once contending for the links (each hides behind its own window), host gaps beyond
one launch per kernel.
"""

from __future__ import annotations

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.analysis.kernels import Kernel, Program
from t5scale.errors import ConfigError
from t5scale.whatif.figures import GpuFigures
from t5scale.whatif.nccl import collective_seconds, full_bytes, placement
from t5scale.whatif.program_time import ProgramTime, timed_program

# What one kernel costs beyond its own work. NVIDIA's "Getting Started with CUDA Graphs"
# (developer.nvidia.com/blog/cuda-graphs/) times a 2.9 µs kernel at 3.8 µs per kernel when
# launches queue back to back on one stream, about 1 µs of gap each, and at several times that
# when the host waits on each; XLA:GPU's runtime adds its own host work per thunk. 2 µs sits
# between the queued gap and the host-bound cost; measured steps are to refit it.
KERNEL_LAUNCH_S = 2e-6
_FLOAT32 = ("f32", "f64")


def _achieved_flops(kernel: Kernel, cluster: GpuFigures) -> float:
    """The FLOP/s `kernel`'s arithmetic runs at: its class's efficiency of its dtype's peak."""
    if kernel.is_fp8_gemm:
        if cluster.peak_flops_float8 is None:
            raise ConfigError("the program has FP8 GEMMs and the cluster's GPU no FP8 peak "
                              "(ClusterConfig.peak_flops_float8)")  # fmt: skip
        return cluster.peak_flops_float8 * cluster.gemm_efficiency_float8
    peak = cluster.peak_flops_float32 if kernel.dtype in _FLOAT32 else cluster.peak_flops
    efficiency = (
        cluster.attention_efficiency if kernel.kind == "attention" else cluster.gemm_efficiency
    )
    return peak * efficiency


def kernel_seconds(
    kernel: Kernel,
    cluster: GpuFigures,
    fit_factor: float = 1.0,
    launch_s: float = KERNEL_LAUNCH_S,
) -> float:
    """One run of `kernel`: the slower of its FLOPs and its bytes, over `fit_factor`, plus its
    launch."""
    arithmetic = kernel.flops / _achieved_flops(kernel, cluster)
    memory = (kernel.bytes_read + kernel.bytes_written) / (
        cluster.memory_bandwidth * cluster.memory_efficiency
    )
    return max(arithmetic, memory) / fit_factor + launch_s


def collective_run_seconds(op: CollectiveOp, devices: int, cluster: GpuFigures) -> float:
    """One run of a collective, placed on the nodes by its replica group."""
    where = placement(op.group, devices, cluster.gpus_per_node)
    return collective_seconds(op.kind, full_bytes(op), where, cluster)


def predict_program(
    program: Program,
    cluster: GpuFigures,
    devices: int | None = None,
    fit_factor: float = 1.0,
    launch_s: float = KERNEL_LAUNCH_S,
) -> ProgramTime:
    """Seconds per step of `program` on `cluster` (module docstring). `devices`: how many the
    program spans, by default as its HLO says."""
    if fit_factor <= 0:
        raise ValueError(f"fit_factor must be > 0, got {fit_factor!r}")
    devices = program.devices if devices is None else devices
    each = [kernel_seconds(kernel, cluster, fit_factor, launch_s) for kernel in program.kernels]
    launches = sum(kernel.runs for kernel in program.kernels)
    return timed_program(
        program, each, lambda op: collective_run_seconds(op, devices, cluster), launches * launch_s
    )
