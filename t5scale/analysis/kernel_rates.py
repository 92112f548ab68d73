"""The rates a profiled step's kernels ran at, kernel by kernel: the bytes a second of its
fusions and copies by kernel size, and its attention kernels' time by pass. What the cluster
model's memory_efficiency and attention_efficiency stand for, read from the card (issue 59,
point 5), where device_profile.py gives each class's total."""

from __future__ import annotations

import dataclasses
from collections import Counter

from t5scale.analysis.device_profile import Trace, program_kernels
from t5scale.analysis.hlo_module import Module
from t5scale.analysis.kernels import T5_ATTENTION, instruction_kernels

# (the least bytes a kernel of the band reads and writes, its label), largest first
SIZE_BANDS = ((64e6, "over 64 MB"), (4e6, "4–64 MB"), (0.0, "under 4 MB"))


@dataclasses.dataclass(frozen=True)
class SizeBand:
    """The fusions and copies of one size band, per step."""

    label: str
    kernels: float
    bytes: float  # read and written, as the kernel inventory counts them
    seconds: float

    @property
    def rate(self) -> float:
        """Bytes a second (0 where no time was spent)."""
        return self.bytes / self.seconds if self.seconds else 0.0


def bandwidth_by_size(trace: Trace, module: Module, steps: int) -> list[SizeBand]:
    """The step's fusion and copy kernels that join an instruction, by SIZE_BANDS."""
    events, _ = program_kernels(trace, module)
    kernels = instruction_kernels(module)
    count, moved, micros = Counter(), Counter(), Counter()
    for event in events:
        kernel = kernels.get(event.hlo_op or "")
        if kernel is None or kernel.kind not in ("fusion", "copy"):
            continue
        size = kernel.bytes_read + kernel.bytes_written
        label = next(label for least, label in SIZE_BANDS if size >= least)
        count[label] += 1
        moved[label] += size
        micros[label] += event.duration_us
    return [
        SizeBand(label, count[label] / steps, moved[label] / steps, micros[label] * 1e-6 / steps)
        for _, label in SIZE_BANDS
    ]


def attention_by_pass(trace: Trace, steps: int) -> dict[str, float]:
    """Seconds per step of t5scale's attention kernels by pass (forward, backward_dkv,
    backward_dq, backward_bias; `_causal` apart), from the kernels' own names."""
    seconds: Counter[str] = Counter()
    for event in trace.kernels:
        if named := T5_ATTENTION.search(event.name):
            seconds[named.group(0)] += event.duration_us * 1e-6 / steps
    return dict(sorted(seconds.items()))
