"""The GPU check's device profile of a step item (bench/gpu_check.py, issue 59): three more
steps under jax.profiler, after the timed ones, saved for t5scale/analysis/device_profile.py to
read on any machine (bench/gpu_profile_table.py prints its table).

OUT/profiles/<item with _>/ holds, small enough to carry back from a lent GPU:
- trace.json.gz: the trace jax's `create_perfetto_trace` writes (XLA's trace-viewer JSON of the
  profile, metadata dropped): each kernel on the device's streams with its HLO op, or on the CPU
  each XLA:CPU operation on the host's threads;
- program.hlo.txt.gz: the program that ran (on the dry run not the H100 program that
  programs.zip holds), whose instructions name the kernels' classes.

The profiler is a bonus: where it fails (no CUPTI, anything) the item writes why and goes on.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpu_check_list import Results

PROFILED_STEPS = 3
# The profile is skipped for a step slower than this over three (a step's timing cut short,
# docs/gpu_check.md), and given up, the item's process ended, past the deadline: a profiler
# that hangs must not take the budget of the items after it.
PROFILE_AT_MOST_S = 15.0
PROFILE_DEADLINE_S = 60.0
_KEPT = "trace.json.gz"
_PROGRAM = "program.hlo.txt.gz"


def profile_directory(out: Path, item: str) -> Path:
    return out / "profiles" / item.replace(" ", "_")


def profile_steps(results: Results, step, state, batches: list[Any], step_s: float) -> None:
    """Profiles PROFILED_STEPS steps from `state` (the timed steps' last, whose buffers the next
    step donates) into the item's profile directory; writes what it saved, or why not."""
    if PROFILED_STEPS * step_s > PROFILE_AT_MOST_S:
        results.write(profile=None, why=f"{PROFILED_STEPS} steps of {step_s:.1f} s: not profiled")
        return
    directory = profile_directory(results.path.parent, results.item)
    started = time.perf_counter()
    deadline = threading.Timer(PROFILE_DEADLINE_S, _give_up, (results, directory))
    deadline.start()
    try:
        _capture(step, state, batches, directory)
        kernels = _kernel_events(directory)
    except Exception as error:  # noqa: BLE001 (a failing profiler costs the profile alone)
        shutil.rmtree(directory, ignore_errors=True)
        results.write(profile=None, why=f"{type(error).__name__}: {error}"[:300])
        return
    finally:
        deadline.cancel()
    results.write(
        profile=str(directory.relative_to(results.path.parent)),
        profiled_steps=PROFILED_STEPS,
        profile_bytes={path.name: path.stat().st_size for path in sorted(directory.iterdir())},
        profile_s=time.perf_counter() - started,
        **kernels,
    )


def _give_up(results: Results, directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)  # what it left there would travel back
    results.write(profile=None, why=f"the profiler took over {PROFILE_DEADLINE_S:.0f} s")
    os._exit(0)  # the item's results are written; what hangs is the profiler alone


def _capture(step, state, batches: list[Any], directory: Path) -> None:
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    jax.block_until_ready(state)  # nothing of an earlier step in the profile
    # No Python tracer: its events would outnumber the kernels and say nothing of the device.
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory(dir=directory) as raw:
        with jax.profiler.trace(raw, create_perfetto_trace=True, profiler_options=options):
            # Dispatched back to back, as a training loop runs them: the device's idle time is
            # its own, not the host's wait between steps.
            for index in range(PROFILED_STEPS):
                state, _ = step.compiled(state, batches[index % len(batches)])
            jax.block_until_ready(state)
        (trace,) = Path(raw).glob("plugins/profile/*/perfetto_trace.json.gz")
        shutil.move(trace, directory / _KEPT)
    with gzip.open(directory / _PROGRAM, "wt") as program:
        program.write(step.compiled.as_text())


def _kernel_events(directory: Path) -> dict[str, Any]:
    """The trace's kernel events, counted: none on a GPU means the device tracer saw nothing
    (CUPTI missing, say), which the table would otherwise show as an empty step."""
    from t5scale.analysis.device_profile import read_trace

    events = read_trace(directory / _KEPT)
    fields: dict[str, Any] = {
        "profile_events": len(events.kernels),
        "profile_events_with_hlo_op": sum(bool(e.hlo_op) for e in events.kernels),
        "profile_on": events.source,
    }
    if not events.kernels:
        fields["why"] = "the trace holds no kernel events (is CUPTI installed?)"
    return fields
