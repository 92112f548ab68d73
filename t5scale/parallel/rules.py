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


def zero_multiple(logical_axes: tuple[str | None, ...], dim: int, zero_size: int,
                  tensor_size: int) -> int:  # fmt: skip
    """What the size of dimension `dim` must be a multiple of to split over `zero`: the zero
    size, times the tensor size on the vocabulary (which both axes split)."""
    return zero_size * (tensor_size if logical_axes[dim] == "vocab" else 1)


def zero_dim(
    logical_axes: tuple[str | None, ...],
    shape: tuple[int, ...],
    zero_size: int,
    tensor_size: int = 1,
) -> int | None:
    """The dimension a ZeRO stage shards over `zero` (None: zero size 1, or no dimension that
    may be split). Where no candidate divides, the one returned is padded
    (t5scale/parallel/layout.py), as DeepSpeed pads its flat buffers to the shard count.

    `vocab` comes first: split by vocabulary, stage 3 never gathers the 250k-row tables (it
    moves the batch's activations instead, t5scale/parallel/vocab.py). Then `embed` (as in FSDP
    setups: it is never split by tensor parallelism); otherwise the largest remaining dimension
    that is not tensor-parallel and divides by the zero size. Where nothing divides: the
    vocabulary, else the dimension that padding grows least.
    """
    if zero_size == 1:
        return None
    candidates = [
        dim
        for dim, name in enumerate(logical_axes)
        if name == "vocab" or (name not in TENSOR_RULES and name not in NEVER_ZERO_SHARDED)
    ]
    if not candidates:
        return None

    def multiple(dim: int) -> int:
        return zero_multiple(logical_axes, dim, zero_size, tensor_size)

    dividing = [dim for dim in candidates if shape[dim] % multiple(dim) == 0]
    vocab = [dim for dim in candidates if logical_axes[dim] == "vocab"]
    if vocab and vocab[0] in dividing:
        return vocab[0]
    embed = [dim for dim in dividing if logical_axes[dim] == "embed"]
    if embed:
        return embed[0]
    dividing = [dim for dim in dividing if logical_axes[dim] != "vocab"]
    if dividing:
        return max(dividing, key=lambda dim: shape[dim])
    if vocab:
        return vocab[0]

    def growth(dim: int) -> tuple[float, int]:
        return (-(-shape[dim] // multiple(dim)) * multiple(dim) / shape[dim], -shape[dim])

    return min(candidates, key=growth)


def activation_spec(logical_axes: tuple[str | None, ...]) -> P:
    """Sharding of an activation inside the data-parallel shard_map: only `tensor` is automatic."""
    return P(*tensor_axes(logical_axes))
