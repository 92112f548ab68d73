"""Logical axis names → mesh axes (t5x's convention), and the dimension ZeRO shards.

Parameters and activations carry logical names (`embed`, `heads`, `mlp`, …). Tensor parallelism
is a fixed rule: heads, mlp and vocab are split over `tensor`. ZeRO then picks, per parameter, one
dimension to split over `zero`: the vocabulary of the embedding and the output projection (there
it shares the dimension with `tensor`, zero-major), elsewhere one that `tensor` does not split.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

TENSOR_RULES: dict[str, str] = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
# Scanned layers are sliced one at a time; sharding that axis would gather the whole stack.
NEVER_ZERO_SHARDED = ("layers",)


def tensor_axes(logical_axes: tuple[str | None, ...]) -> list[str | None]:
    return [TENSOR_RULES.get(name) if name else None for name in logical_axes]


def zero_dim(
    logical_axes: tuple[str | None, ...],
    shape: tuple[int, ...],
    zero_size: int,
    tensor_size: int = 1,
) -> int | None:
    """The dimension a ZeRO stage shards over `zero`, or None when none divides evenly.

    `vocab` comes first: split by vocabulary, stage 3 never gathers the 250k-row tables (it
    moves the batch's activations instead, t5scale/parallel/vocab.py). Then `embed` (as in FSDP
    setups: it is never split by tensor parallelism); otherwise the largest remaining dimension
    that is not tensor-parallel and divides by the zero size.
    """
    if zero_size == 1:
        return None
    if "vocab" in logical_axes:
        vocab = logical_axes.index("vocab")
        if shape[vocab] % (zero_size * tensor_size) == 0:
            return vocab
    candidates = [
        d
        for d, name in enumerate(logical_axes)
        if name not in TENSOR_RULES and name not in NEVER_ZERO_SHARDED and shape[d] % zero_size == 0
    ]
    if not candidates:
        return None
    embed = [d for d in candidates if logical_axes[d] == "embed"]
    return embed[0] if embed else max(candidates, key=lambda d: shape[d])


def activation_spec(logical_axes: tuple[str | None, ...]) -> P:
    """Sharding of an activation inside the data-parallel shard_map: only `tensor` is automatic."""
    return P(*tensor_axes(logical_axes))
