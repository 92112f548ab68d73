"""Step metrics: a JSON line per step in MODEL_DIR/metrics.jsonl, and progress on the terminal."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _keep_records_up_to(path: Path, step: int) -> None:
    """Rewrite `path` (atomically) with only its records of steps 1..`step`."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
    partial = path.with_suffix(".jsonl.partial")
    partial.write_text("".join(kept), encoding="utf-8")
    partial.replace(path)


class MetricsLog:
    """Appends one JSON object per step and prints a progress line every `print_every` steps.

    A run resumed at step `resume_at` first drops the records after that step (a killed run may
    have logged steps it never checkpointed), so the file reads as one uninterrupted run.
    """

    def __init__(
        self,
        model_dir: str | None,
        total_steps: int,
        print_every: int = 1,
        stream: TextIO | None = None,
        resume_at: int = 0,
        show: bool = True,
    ):
        self.total_steps = total_steps
        self.print_every = max(1, print_every)
        self.show = show  # False: file only (the processes other than process 0)
        self.stream = stream or sys.stdout  # looked up now: sys.stdout may be replaced
        self.step_times: list[float] = []
        self.started = time.perf_counter()
        self.file = None
        if model_dir:
            Path(model_dir).mkdir(parents=True, exist_ok=True)
            path = Path(model_dir) / "metrics.jsonl"
            _keep_records_up_to(path, resume_at)
            self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self.step_times.append(record["step_time_s"])
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        step = record["step"]
        if self.show and (step % self.print_every == 0 or step == self.total_steps):
            # The median of recent steps is robust to a slow first step or a hiccup.
            recent = statistics.median(self.step_times[-20:])
            eta = _duration(recent * (self.total_steps - step))
            print(
                f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}  "
                f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tokens/s  "
                f"{record['step_time_s']:.3f} s/step  ETA {eta}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.file:
            self.file.close()
