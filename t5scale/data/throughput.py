"""What the input pipeline alone delivers (`t5scale data-bench`): examples, tokens and token
slots per second, with no model behind it."""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

from t5scale.data.config import DataConfig
from t5scale.data.loader import host_batches


@dataclasses.dataclass(frozen=True)
class Throughput:
    """`batches` host batches of `rows` sequences read in `seconds`, after the first (whose
    wait, the pipeline's start included, is `ready_s`)."""

    data: DataConfig
    ready_s: float
    batches: int
    rows: int
    seconds: float
    examples: int  # packed examples: one per segment id per row
    tokens: int  # non-padding tokens, inputs and targets

    @property
    def slots(self) -> int:
        """Token slots, padding included: what the step's tokens/s count."""
        return self.batches * self.rows * (self.data.input_length + self.data.target_length)

    def line(self) -> str:
        data, seconds = self.data, self.seconds
        return (
            f"{data.source}: {self.batches} batches of {self.rows} in {seconds:.2f} s: "
            f"{self.examples / seconds:,.0f} examples/s, {self.tokens / seconds:,.0f} tokens/s "
            f"({self.slots / seconds:,.0f} token slots/s incl. padding; lengths "
            f"{data.input_length}/{data.target_length})"
        )


def measure_throughput(
    data: DataConfig, batch_size: int, seed: int, vocab_size: int, batches: int
) -> Throughput:
    """Read one batch (the pipeline's start), then time `batches` more."""
    started = time.perf_counter()
    stream = host_batches(data, batch_size, seed, vocab_size)
    first = next(stream)
    ready_s = time.perf_counter() - started
    examples = tokens = done = 0
    started = time.perf_counter()
    for batch in itertools.islice(stream, batches):
        examples += sum(len(np.unique(row[row > 0])) for row in batch.encoder_segment_ids)
        tokens += int(np.count_nonzero(batch.encoder_input_tokens))
        tokens += int(np.count_nonzero(batch.decoder_target_tokens))
        done += 1
    rows = first.rows
    return Throughput(data, ready_s, done, rows, time.perf_counter() - started, examples, tokens)
