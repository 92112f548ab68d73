"""A collective over a TPU slice's ICI torus, in seconds: the jax-ml scaling book's model
("How to Scale Your Model", the sharding chapter: jax-ml.github.io/scaling-book/sharding/).

    seconds(kind, bytes, axes, link_bandwidth)   over the torus axes a replica group spans
    op_seconds(op, devices, slice, link_bandwidth)  one of a compiled program's collectives
    dcn_op_seconds(op, slices, bandwidth per chip)  one of its transfers between slices

An all-gather (or a reduce-scatter: its transpose) of an array of V bytes over N chips moves
(N − 1)/N · V into (or out of) each chip. Each torus axis it spans carries it both ways round
where the axis closes into a ring (`TpuSlice.wraparound`): two links of the axis at once,
`link_bandwidth` each, one way; an axis without wraparound is a line, whose far ends only one
direction reaches, and it takes twice as long ("typically doubles the time", the book). Each
hop also costs a fixed latency, about 1 µs: a ring needs N/2 hops, a line N − 1, and a small
collective is bound by them. An all-reduce is a reduce-scatter then an all-gather.

    T = max(hops · latency, (N − 1)/N · V / Σ_axes bandwidth(axis))

The book's worked answers round (N − 1)/N to 1 where they say "≈ V / W"; its summary keeps it,
and so does this (tests/test_ici_dcn.py re-predicts its examples).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.xla_tpu import TpuSlice

# "T_min … typically around 1us" per hop (the book's sharding chapter).
HOP_LATENCY_S = 1e-6
KINDS = ("all-gather", "reduce-scatter", "all-reduce")


@dataclasses.dataclass(frozen=True)
class TorusAxis:
    """One axis of the torus a collective spans: how many chips along it, and whether it
    closes into a ring."""

    size: int
    wraps: bool

    @property
    def hops(self) -> int:
        """Hops until every chip has every other's part: both ways round a ring, one way
        along a line."""
        return self.size // 2 if self.wraps else self.size - 1

    def bandwidth(self, link_bandwidth: float) -> float:
        """Bytes per second each chip takes in along this axis: both neighbours on a ring,
        one (on average) along a line."""
        return (2 if self.wraps else 1) * link_bandwidth


def seconds(
    kind: str,
    array_bytes: float,
    axes: Sequence[TorusAxis],
    link_bandwidth: float,
    hop_latency_s: float = HOP_LATENCY_S,
) -> float:
    """One collective over `axes`: `array_bytes` is the whole array (an all-gather's result, a
    reduce-scatter's or an all-reduce's operand), `link_bandwidth` one ICI link's, one way."""
    if kind not in KINDS:
        raise ValueError(f"a collective of {', '.join(KINDS)}, got {kind!r}")
    axes = [axis for axis in axes if axis.size > 1]
    if not axes:
        return 0.0
    chips = math.prod(axis.size for axis in axes)
    moved = (chips - 1) / chips * array_bytes
    throughput = moved / sum(axis.bandwidth(link_bandwidth) for axis in axes)
    latency = hop_latency_s * sum(axis.hops for axis in axes)
    one_pass = max(latency, throughput)
    return 2 * one_pass if kind == "all-reduce" else one_pass


def slice_axes(shape: Sequence[int], wraparound: Sequence[bool]) -> tuple[TorusAxis, ...]:
    """A slice's torus as axes (`TpuSlice.shape`, `TpuSlice.wraparound`)."""
    return tuple(TorusAxis(size, wraps) for size, wraps in zip(shape, wraparound, strict=True))


# XLA:TPU's forms that are all-reduces in the program, whatever collective they stand for
# (t5scale/analysis/hlo.py): they cost an all-reduce, twice a reduce-scatter or an all-gather.
ALL_REDUCE_FORMS = ("all-reduce+slice", "all-reduce of a zero-padded part")


def op_seconds(
    op: CollectiveOp, devices: Sequence, torus: TpuSlice, link_bandwidth: float
) -> float | None:
    """Seconds per step of one of the program's collectives over the slice's ICI: its replica
    group (positions in `devices`, the mesh's devices in order) placed on the torus axes it
    spans, by the chips' coordinates; a group that spans only part of an axis is a line. None
    where this model has no answer: a transfer between slices (DCN), a kind it does not time."""
    kind = "all-reduce" if op.form in ALL_REDUCE_FORMS else op.kind
    if op.form == "dcn" or kind not in (*KINDS, "collective-permute"):
        return None
    members = [devices[i] for i in op.group] if op.group else list(devices)
    if len({getattr(device, "slice_index", 0) for device in members}) > 1:
        return None
    if kind == "collective-permute":
        return op.count * permute_seconds(op.bytes, *members[:2], torus, link_bandwidth)
    axes = []
    for axis, (size, wraps) in enumerate(zip(torus.shape, torus.wraparound, strict=True)):
        spanned = len({device.coords[axis] for device in members})
        axes.append(TorusAxis(spanned, wraps and spanned == size))
    # The whole array: an all-gather's result, a reduce-scatter's or an all-reduce's operand.
    array_bytes = max(op.bytes, op.operand_bytes)
    return op.count * seconds(kind, array_bytes, axes, link_bandwidth)


def permute_seconds(
    array_bytes: float, source, target, torus: TpuSlice, link_bandwidth: float,
    hop_latency_s: float = HOP_LATENCY_S,
) -> float:  # fmt: skip
    """One collective permute's pair (a pipeline's stage boundary): `array_bytes` from `source`
    to `target` chip over one ICI link's bandwidth, routed through the hops between them (the
    shorter way round where an axis wraps)."""
    hops = 0
    for axis, (size, wraps) in enumerate(zip(torus.shape, torus.wraparound, strict=True)):
        apart = abs(source.coords[axis] - target.coords[axis])
        hops += min(apart, size - apart) if wraps else apart
    return max(hops * hop_latency_s, array_bytes / link_bandwidth) if hops else 0.0


def dcn_op_seconds(op: CollectiveOp, slices: int, dcn_bandwidth_per_chip: float) -> float | None:
    """Seconds per step of one of XLA:TPU's collectives between slices (form 'dcn': the
    payload each chip hands its megascale runtime, read from the program), each chip's share of
    its host's data-centre network at once: an all-gather brings the other slices' parts, a
    reduce-scatter sends (S − 1)/S of the payload, an all-reduce both. No latency term (no
    figure found): a lower bound. None for any other collective."""
    if op.form != "dcn" or slices < 2 or op.kind not in (*KINDS, "collective-permute"):
        return None
    others = (slices - 1) / slices
    moved = {
        "collective-permute": op.bytes,  # to one chip of another slice
        "all-gather": (slices - 1) * op.bytes,
        "reduce-scatter": others * op.bytes,
        "all-reduce": 2 * others * op.bytes,
    }[op.kind]
    return op.count * moved / dcn_bandwidth_per_chip
