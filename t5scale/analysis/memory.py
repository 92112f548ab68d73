"""Per-device memory: XLA's compiled analysis beside the ZeRO formula.

The ZeRO paper gives per-device model-state bytes for Ψ parameters on N_d shards with
mixed-precision Adam (2Ψ fp16 parameters, 2Ψ fp16 gradients, 12Ψ fp32 master copy and moments).
Here the byte counts per parameter come from the real trees instead — float32 parameters and
gradients and whatever the optimizer keeps — and the stage table says which are divided by N_d.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from t5scale.parallel.zero import ZeroStage

CPU_MEMORY_SHARE = 0.8  # of the host's memory, for all emulated devices together


def cpu_memory_budget(host_memory_bytes: int, devices: int) -> int:
    """Per-device memory budget of `devices` emulated CPU devices: they share the host's memory,
    less a margin for the process itself."""
    return int(CPU_MEMORY_SHARE * host_memory_bytes / devices)


def tree_bytes(tree: Any) -> int:
    """Total bytes of a tree of arrays or ShapeDtypeStructs (global, not per device)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def per_device_bytes(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of `tree` under `shardings` (its largest shard, leaf by leaf)."""

    def shard_bytes(leaf, sharding) -> int:
        return math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize

    return sum(jax.tree.leaves(jax.tree.map(shard_bytes, tree, shardings)))


@dataclasses.dataclass(frozen=True)
class ModelStateBytes:
    """Global bytes of the three trees a ZeRO stage decides about."""

    parameters: int
    gradients: int
    optimizer_state: int

    def per_device(self, stage: ZeroStage, shards: int) -> dict[str, float]:
        """The ZeRO formula: each tree divided by N_d where the stage shards it."""
        parts = {
            "parameters": self.parameters / (shards if stage.shard_parameters else 1),
            "gradients": self.gradients / (shards if stage.shard_gradients else 1),
            "optimizer_state": self.optimizer_state
            / (shards if stage.shard_optimizer_state else 1),
        }
        return parts | {"total": sum(parts.values())}


def model_state_bytes(abstract_params: Any, abstract_opt_state: Any) -> ModelStateBytes:
    """Gradients have the parameters' dtype and shape (the accumulator too)."""
    params = tree_bytes(abstract_params)
    return ModelStateBytes(params, params, tree_bytes(abstract_opt_state))


def compiled_memory(compiled) -> dict[str, int]:
    """XLA's per-device memory analysis of a compiled program, as plain integers."""
    analysis = compiled.memory_analysis()
    fields = ("argument", "output", "temp", "alias", "generated_code")
    stats = {f"{name}_bytes": int(getattr(analysis, f"{name}_size_in_bytes")) for name in fields}
    # Donated arguments alias outputs, so the live peak is arguments + outputs - aliased + temps.
    stats["peak_estimate_bytes"] = (
        stats["argument_bytes"] + stats["output_bytes"] - stats["alias_bytes"] + stats["temp_bytes"]
    )
    return stats
