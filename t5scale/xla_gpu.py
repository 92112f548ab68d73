"""Compiling for GPUs that are not here: XLA:GPU's own program, memory and schedule, deviceless.

jax's CUDA plugin (the `gpu` extra) carries XLA's GPU compiler. Given a description of the GPU
(a GpuTargetConfig, t5scale/gpu_targets/) it makes compile-only devices, `nodes` processes of
`gpus_per_node` GPUs each (jax.experimental.topologies), and a step lowered over a mesh of them
compiles as it would on the cluster, with nothing allocated and nothing run. The machine may
have no GPU at all (JAX then runs on the CPU: t5scale/startup.py).

What differs from compiling on the GPU itself (docs/cluster_model.md says more):
- no autotuning: XLA picks GEMM algorithms and fusion tilings by its heuristics, not by timing
  candidates on the card;
- `xla_gpu_enable_triton_gemm=False`: GEMMs go to cuBLAS(Lt) custom calls. Triton's GEMM tile
  choice needs the autotuner and fails without it ("Couldn't find output tile sizes"); on the
  card XLA may choose a Triton GEMM for some products instead, with the same FLOPs and bytes;
- no machine code: ptxas is a stand-in (`PTXAS_STAND_IN`), which assembles nothing, and LLVM runs
  unoptimised (`MACHINE_CODE_UNUSED`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
from jax.experimental import topologies

from t5scale.errors import ConfigError
from t5scale.startup import captured_stderr, cuda_plugin_installed

TARGETS_DIR = Path(__file__).parent / "gpu_targets"
INSTALL_HINT = "pip install 't5scale[gpu-compile]' (jax's CUDA 12 plugin, Linux only)"
# What a t5scale job on GPUs compiles with: launch/xla_gpu_flags.sh sets these as XLA_FLAGS
# (tests/test_launch.py checks that the two agree), so the compile-only program is the job's.
# XLA:GPU combines collectives of one kind up to this size (the cluster model assumes the same
# on its CPU path: t5scale/whatif/step_time.py).
COMBINE_THRESHOLD_BYTES = 134_217_728
LAUNCH_FLAGS: dict[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_all_gather_combine_threshold_bytes": COMBINE_THRESHOLD_BYTES,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": COMBINE_THRESHOLD_BYTES,
    "xla_gpu_all_reduce_combine_threshold_bytes": COMBINE_THRESHOLD_BYTES,
}
# Each compile for compile-only GPU devices: the job's flags, and cuBLAS for every GEMM (the
# module docstring says why).
COMPILER_OPTIONS: dict[str, Any] = LAUNCH_FLAGS | {"xla_gpu_enable_triton_gemm": False}


def target_names() -> list[str]:
    return sorted(path.stem for path in TARGETS_DIR.glob("*.txtpb"))


def target_text(target: str) -> str:
    """The GpuTargetConfig text of `target`: a name in t5scale/gpu_targets/ or a file's path."""
    path = TARGETS_DIR / f"{target}.txtpb"
    if not path.exists():
        path = Path(target)
    if not path.is_file():
        raise ConfigError(
            f"GPU compile target {target!r}: neither one of {', '.join(target_names())} nor a "
            "file (a GpuTargetConfig in protobuf text form)"
        )
    return path.read_text()


@dataclasses.dataclass(frozen=True)
class GpuTopology:
    """`nodes` processes × `gpus_per_node` GPUs of `target`, to compile for."""

    target: str
    nodes: int = 1
    gpus_per_node: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(
                f"a GPU topology needs >= 1 node and GPU, got {self.nodes} x {self.gpus_per_node}"
            )

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node

    def devices(self) -> list:
        """The compile-only devices, process-major (device i is on process i // gpus_per_node)."""
        return list(_topology(self.target, self.nodes, self.gpus_per_node).devices)


def require_plugin() -> None:
    """A ConfigError that names the install command where jax's CUDA plugin is missing."""
    if not cuda_plugin_installed():
        raise ConfigError(f"compiling for GPUs needs jax's CUDA plugin: {INSTALL_HINT}")


@functools.cache
def _topology(target: str, nodes: int, gpus_per_node: int):
    require_plugin()
    text = target_text(target)
    with captured_stderr() as said:  # XLA's parser says what is wrong on stderr
        try:
            return topologies.get_topology_desc(
                platform="cuda", target_config=text, topology=f"{nodes}x1x{gpus_per_node}"
            )
        except jax.errors.JaxRuntimeError as error:
            failure = error
    where = [line.split("] ", 1)[-1].strip() for line in said if "text_format" in line]
    reason = where[0] if where else str(failure).splitlines()[0]
    raise ConfigError(
        f"GPU compile target {target!r} is not a GpuTargetConfig XLA can read: {reason}"
    )


def is_compile_only_gpu(devices) -> bool:
    """Whether `devices` are compile-only GPU devices (no backend of this process has them)."""
    device = next(iter(devices))
    return device.platform == "gpu" and device not in jax.devices()


def compiler_options(devices) -> dict[str, Any]:
    """The options of a compile for `devices`: on compile-only GPUs, COMPILER_OPTIONS, this
    process's kernel cache for their kind of GPU (`kernel_cache_file`), the ptxas stand-in
    (`PTXAS_STAND_IN`) and LLVM unoptimised (`MACHINE_CODE_UNUSED`)."""
    devices = list(devices)
    if not is_compile_only_gpu(devices):
        return {}
    return (
        COMPILER_OPTIONS
        | MACHINE_CODE_UNUSED
        | {
            "xla_gpu_kernel_cache_file": kernel_cache_file(devices[0]),
            "xla_gpu_cuda_data_dir": str(_work_dir()),
        }
    )


# A compile-only program's kernels are never run, so optimising their LLVM IR is wasted work:
# LLVM at -O0 takes 17% less CPU on a cold mt5_base stage-3 compile (docs/benchmarks.md). It
# changes only the PTX; everything t5scale reads (HLO passes, fusion, schedule, buffer
# assignment, cost analysis) is done before LLVM runs, and tests/test_xla_gpu.py compiles a
# program again at LLVM's default level and compares.
MACHINE_CODE_UNUSED: dict[str, Any] = {"xla_backend_optimization_level": 0}


# A compile-only program's machine code is never loaded, so assembling it is wasted work: XLA
# runs ptxas once for each new kernel, a process of ~25 ms each: 16% of the CPU of a grid's
# compiles here, kernel cache and all (docs/benchmarks.md).
# XLA looks for ptxas first in `xla_gpu_cuda_data_dir`/bin; there t5scale puts this stand-in,
# which writes an empty cubin. Everything t5scale reads (HLO passes, fusion, schedule, buffer
# assignment, cost analysis) comes before ptxas and is unchanged: tests/test_xla_gpu.py
# compiles a program with the real ptxas as well and compares. It reports the CUDA 12.9 ptxas
# (the version only shapes the PTX text). libdevice still comes from a CUDA toolkit or from
# the nvidia-cuda-nvcc-cu12 wheel, which the gpu-compile extra installs.
PTXAS_STAND_IN = """#!/bin/sh
# t5scale's ptxas for compile-only GPU programs (t5scale/xla_gpu.py): no machine code.
if [ "$1" = "--version" ]; then
  echo "ptxas: NVIDIA (R) Ptx optimizing assembler (t5scale stand-in: no machine code)"
  echo "Cuda compilation tools, release 12.9, V12.9.86"
  exit 0
fi
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then : > "$2"; fi
  shift
done
"""


@functools.cache
def _work_dir() -> Path:
    """This process's folder for compile-only GPU programs (removed at exit): the kernel
    caches, and bin/ptxas, the stand-in."""
    path = Path(tempfile.mkdtemp(prefix="t5scale-xla-gpu-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    ptxas = path / "bin" / "ptxas"
    ptxas.parent.mkdir()
    ptxas.write_text(PTXAS_STAND_IN)
    ptxas.chmod(0o755)
    return path


def kernel_cache_file(device) -> str:
    """Where XLA keeps the GPU kernels this process has compiled for `device`'s kind, so that a
    later program reuses a kernel it already has (same fused computation and launch) instead of
    running LLVM again: the programs of a grid (node counts, stages) share most of their
    kernels. Only the kernels' code is reused; the HLO, its schedule and memory are each
    program's own. The cache lives and dies with the process, one file per kind of GPU (code
    is per architecture) and per thread (XLA rewrites the file after each compile), so no two
    compiles share one at once."""
    kind = re.sub(r"[^A-Za-z0-9]+", "_", device.device_kind).strip("_")
    return str(_work_dir() / f"{kind}-thread{threading.get_ident()}.bin")


def compiler_name(devices) -> str:
    """The compiler that makes a program for `devices`, as plan and simulate report it."""
    devices = list(devices)
    if devices[0].platform != "gpu":
        return f"xla:{devices[0].platform}"
    nodes = len({device.process_index for device in devices})
    per_node = len(devices) // nodes
    return f"xla:gpu {devices[0].device_kind}, {nodes} node{'s' if nodes > 1 else ''} x {per_node}"
