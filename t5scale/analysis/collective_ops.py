"""The collectives of a compiled program as records: each one with how often it runs per step
(`CollectiveOp`, what the cluster model times), and their totals per kind (`Collectives`, what
reports show). t5scale/analysis/hlo.py finds them in the HLO text."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Self

from t5scale.jsonform import JsonRecord

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
UNKNOWN_LOOPS = "unknown_trip_count_loops"
WIDENED = "widened_by_backend"
SLICED = "reduce_scatters_as_all_reduce_and_slice"
PADDED = "all_gathers_as_all_reduce_of_padded_parts"


@dataclasses.dataclass(frozen=True)
class CollectiveOp(JsonRecord):
    """One collective of the program, as the cluster model times it: its kind, how often it
    runs per executed step, its bytes per run on one device, the first of its replica groups
    (devices as positions in the mesh's device list), where it is, and the trip counts of the
    `while` loops around it, outermost first."""

    kind: str
    count: int
    bytes: float  # result bytes (a share of them, once the cluster model combines messages)
    operand_bytes: float
    group: tuple[int, ...] | None  # None: every device
    computation: str  # the computation it is in: XLA's combiners merge only within one
    loops: tuple[int, ...] = ()
    loop_names: tuple[str, ...] = ()  # each loop's op_name (JAX's trace path, `…/encoder/while`)
    # How the program writes it where that differs from its kind: 'all-reduce+slice' (XLA:TPU's
    # reduce-scatter as an all-reduce whose result each device slices its share of), 'dcn'
    # (XLA:TPU's collective between slices, a send to its megascale runtime), 'all-reduce of a
    # zero-padded part' (XLA:TPU's all-gather over a large group: each device's part written
    # into zeros, the parts summed).
    form: str | None = None


@dataclasses.dataclass(frozen=True)
class KindTotal(JsonRecord):
    """One kind's collectives per device per executed step."""

    count: int = 0
    bytes: int = 0  # result bytes
    operand_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Collectives:
    """Per kind, the collectives' totals per device per executed step (kinds that do not occur
    are absent), and notes: loops of unknown trip count, whose bodies were counted once, and
    collectives XLA:CPU widened to f32, counted at the 16-bit size the program asked for.
    In JSON the kinds and the notes are the keys of one object."""

    by_kind: dict[str, KindTotal]
    unknown_trip_count_loops: int = 0
    widened_by_backend: int = 0
    reduce_scatters_as_all_reduce_and_slice: int = 0  # instructions, each counted once
    all_gathers_as_all_reduce_of_padded_parts: int = 0  # likewise

    @classmethod
    def of(
        cls, ops: Iterable[CollectiveOp], unknown_loops: int = 0, widened: int = 0,
        sliced: int = 0, padded: int = 0,
    ) -> Self:  # fmt: skip
        totals: dict[str, KindTotal] = {}
        for op in ops:
            total = totals.get(op.kind, KindTotal())
            totals[op.kind] = KindTotal(
                total.count + op.count,
                total.bytes + op.count * op.bytes,
                total.operand_bytes + op.count * op.operand_bytes,
            )
        by_kind = {kind: totals[kind] for kind in KINDS if kind in totals}
        return cls(by_kind, unknown_loops, widened, sliced, padded)

    def to_json(self) -> dict[str, Any]:
        notes = {UNKNOWN_LOOPS: self.unknown_trip_count_loops, WIDENED: self.widened_by_backend,
                 SLICED: self.reduce_scatters_as_all_reduce_and_slice,
                 PADDED: self.all_gathers_as_all_reduce_of_padded_parts}  # fmt: skip
        kinds = {kind: total.to_json() for kind, total in self.by_kind.items()}
        return kinds | {name: count for name, count in notes.items() if count}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        by_kind = {kind: KindTotal.from_json(data[kind]) for kind in KINDS if kind in data}
        notes = (data.get(name, 0) for name in (UNKNOWN_LOOPS, WIDENED, SLICED, PADDED))
        return cls(by_kind, *notes)

    def summary(self) -> str:
        """One line, e.g. `all-gather 24× 1.5 MiB, reduce-scatter 12× 819.2 KiB` (result
        bytes)."""
        parts = [
            f"{kind} {total.count}× {format_bytes(total.bytes)}"
            for kind, total in self.by_kind.items()
        ]
        line = ", ".join(parts) or "no collectives"
        if loops := self.unknown_trip_count_loops:
            line += f" ({loops} loop{'s' if loops > 1 else ''} of unknown trip count counted once)"
        return line


def format_bytes(size: float) -> str:
    """Bytes in binary units: `512 B`, `1.5 KiB`, `3.0 MiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def collective_summary(stats: Mapping[str, Any]) -> str:
    """`Collectives.summary` of their JSON form (collective_stats')."""
    return Collectives.from_json(stats).summary()
