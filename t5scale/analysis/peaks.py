"""A device's peak FLOP/s, the denominator of MFU: measured on the CPU, datasheet on GPUs.

On the CPU the emulated devices share the same cores, so they share one measured peak (MFU is
taken against the machine, not against devices × peak). On a GPU the peak is the datasheet's
dense figure for the compute dtype; float32 matmuls on NVIDIA GPUs run as TF32 under JAX's
default precision, so fp32 uses the TF32 figure.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from t5scale.target import Target

# Dense (no sparsity) tensor-core FLOP/s per GPU, float32 as TF32: the one table of GPU peaks,
# for MFU on a GPU and for the cluster files (ClusterConfig.gpu). Keyed by the device kind JAX
# reports, as a prefix (the first that matches wins). From NVIDIA's datasheets, which give the
# sparse figures, twice these: H100 Tensor Core GPU (SXM5, PCIe), H200 Tensor Core GPU, A100
# Tensor Core GPU (SXM4).
GPU_DATASHEET = {
    # float8: dense FP8 tensor cores, half the datasheets' "with sparsity" figures; an A100 has
    # none (XLA compiles FP8 dots for it as bf16 GEMMs)
    "NVIDIA H200": {"bfloat16": 989.4e12, "float32": 494.7e12, "float8": 1978.9e12},
    "NVIDIA H100 PCIe": {"bfloat16": 756.0e12, "float32": 378.0e12, "float8": 1513.0e12},
    "NVIDIA H100": {"bfloat16": 989.4e12, "float32": 494.7e12, "float8": 1978.9e12},  # SXM
    "NVIDIA A100": {"bfloat16": 312.0e12, "float32": 156.0e12},  # SXM
}


def _matmul_shape() -> tuple[int, int]:
    """(size, products per sample) of the peak's matmul: on a GPU a chain of 20 products of
    8192², each sample long enough to time; on the CPU one of 2048², an eighth of 4096²'s time
    (a study's start-up measures it) and no slower per FLOP (2026-11-29, the 2-core VM with 8
    emulated devices: 189 against 146 GFLOP/s, so the peak is the higher, as a peak should be)."""
    return (8192, 20) if Target.local().is_gpu else (2048, 1)


def matmul_peak(dtype: str = "float32", repeats: int = 5) -> float:
    """FLOP/s of a large matmul chain on one device in `dtype` (median of `repeats`)."""
    size, inner = _matmul_shape()
    matrix = jax.random.normal(jax.random.key(0), (size, size), jnp.dtype(dtype))

    @jax.jit
    def matmuls(product):
        for _ in range(inner):  # a chain, so none is optimised away
            product = (product @ matrix).astype(product.dtype)
        return product

    matmuls(matrix).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmuls(matrix).block_until_ready()
        times.append(time.perf_counter() - start)
    return inner * 2 * size**3 / statistics.median(times)


def _datasheet_gpu() -> str | None:
    """This process's GPU as GPU_DATASHEET names it; None elsewhere (the CPU, other GPUs)."""
    here = Target.local()
    if not here.is_gpu:
        return None
    kind = here.devices[0].device_kind
    return next((gpu for gpu in GPU_DATASHEET if kind.startswith(gpu)), None)


def datasheet_peak(dtype: str) -> float | None:
    """One device's datasheet peak FLOP/s in `dtype`, where it has one (the GPUs above)."""
    gpu = _datasheet_gpu()
    return None if gpu is None else GPU_DATASHEET[gpu][dtype]


def device_peak(dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    if (gpu := _datasheet_gpu()) is not None:
        return GPU_DATASHEET[gpu][dtype], f"datasheet, {gpu}, dense {dtype}"
    peak = matmul_peak(dtype, repeats=3)
    kind = Target.local().devices[0].device_kind
    return peak, f"measured: {_matmul_shape()[0]}² {dtype} matmul on {kind}, median of 3"
