"""One trial in its own process: compile a grid point, check its memory, time a few steps.

    python -m t5scale.study.trial SPEC.json RESULT.json

The study starts each trial with `run_spec` (`run_trial` for its records), which gives it a
time limit and turns whatever happens to it into a status: ok, out-of-memory, compile error, timeout or crash. A trial that
dies takes nothing else with it. Kind 'machine' probes the backend once per study (peak FLOP/s,
device kind and memory), so that the study's own process never starts an accelerator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from t5scale import xla_cpu
from t5scale.analysis.flops import mfu
from t5scale.analysis.peaks import device_peak
from t5scale.errors import ConfigError, MeshError
from t5scale.parallel.distributed import DistributedConfig, join_processes
from t5scale.study.evidence import median_interval
from t5scale.study.measure import profile_steps, time_steps
from t5scale.study.records import Machine, TrialResult, TrialSpec, TrialTiming
from t5scale.target import Target
from t5scale.train.config import RunConfig
from t5scale.train.tensorboard import ScalarWriter
from t5scale.whatif.compile import ModelStateTooLarge, compile_for, is_memory_refusal

TRIAL_PROGRAM = ("-m", "t5scale.study.trial")

# The trial processes this process runs, each in a session of its own (the terminal's Ctrl-C
# does not reach them): `stop_trials` ends them, and no trial starts after it.
_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()
_stopped = threading.Event()


class TrialsStopped(Exception):
    """The study stopped its trials (Ctrl-C): this one has no result, and none is recorded."""


def stop_trials() -> None:
    """Kill every trial process running, and refuse new ones until `allow_trials`."""
    with _running_lock:
        _stopped.set()
        for child in _running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)


def allow_trials() -> None:
    _stopped.clear()


def run_trial(
    spec: dict[str, Any],
    work_dir: Path,
    name: str,
    timeout_s: float,
    launcher: Sequence[str] = (),
    program: Sequence[str] = TRIAL_PROGRAM,
) -> dict[str, Any]:
    """Run one trial in a child process (under `launcher`, one per host, when it spans hosts);
    always returns a result with a `status`.

    The child is `python <program> SPEC.json RESULT.json`; it writes RESULT.json whole or not at
    all (bench/bench_step.py's transformers baseline is such a program too)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = work_dir / f"{name}.spec.json", work_dir / f"{name}.result.json"
    log_path = work_dir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = os.environ | {
        "JAX_NUM_CPU_DEVICES": str(spec.get("devices_per_process", 1)),
        # the caller's cache if it has one, else the study's own: a point compiled in round 1
        # loads from it in its timed round
        "JAX_COMPILATION_CACHE_DIR": os.environ.get(
            "JAX_COMPILATION_CACHE_DIR", str(work_dir.parent / "compile_cache")
        ),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log, _running_lock:
        if _stopped.is_set():
            raise TrialsStopped(name)
        try:
            child = subprocess.Popen(
                [*launcher, sys.executable, *program, str(spec_path), str(result_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        except OSError as error:  # the launcher gone from PATH since StudyConfig checked it
            return {"status": "crash", "error": f"cannot start the trial: {error}",
                    "wall_s": 0.0, "log": str(log_path)}  # fmt: skip
        _running.add(child)
    code = _wait_for(child, timeout_s)
    if _stopped.is_set():  # killed by stop_trials, or finished meanwhile: not recorded
        raise TrialsStopped(name)
    wall = time.perf_counter() - started
    if result_path.exists():
        result = json.loads(result_path.read_text())
    elif code is None:
        result = {"status": "timeout", "error": f"no result within the {timeout_s:g} s limit"}
    else:
        result = {"status": "crash", "error": _crash_reason(code, log_path)}
    return result | {"wall_s": wall, "log": str(log_path)}


def _wait_for(child: subprocess.Popen, timeout_s: float) -> int | None:
    """The trial's exit code, or None when it ran past `timeout_s` (then killed)."""
    try:
        return child.wait(timeout=timeout_s)
    except BaseException as error:  # the limit, or Ctrl-C here in the main thread (the probe)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        if isinstance(error, subprocess.TimeoutExpired):
            return None
        raise
    finally:
        with _running_lock:
            _running.discard(child)


def run_spec(
    spec: TrialSpec, work_dir: Path, name: str, timeout_s: float, launcher: Sequence[str] = ()
) -> TrialResult:
    """A study's trial in its own process: `run_trial` with the records JSON is made from and
    read into at its files' edges."""
    return TrialResult.from_json(run_trial(spec.to_json(), work_dir, name, timeout_s, launcher))


def _crash_reason(code: int, log_path: Path) -> str:
    if code < 0:
        reason = f"killed by {signal.Signals(-code).name}"
        if -code == signal.SIGKILL:
            reason += " (often the kernel's out-of-memory killer)"
        return reason
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return f"exit code {code}: {lines[-1][:300] if lines else 'no output'}"


# ---- inside the child process ------------------------------------------------------------


def _machine(dtype: str) -> Machine:
    here = Target.local()
    device = here.devices[0]
    peak, source = device_peak(dtype)
    stats = device.memory_stats() or {}
    return Machine(
        backend=here.platform,
        device_kind=device.device_kind,
        device_count=here.size,
        peak_flops_per_s=peak,
        peak_source=source,
        device_memory_limit_bytes=stats.get("bytes_limit"),
        host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    )


def _trial(spec: TrialSpec) -> TrialResult:
    """Compile the point's run; if it fits and the trial is timed, time it."""
    if (
        spec.compile_only_topology is not None
    ):  # a cluster's GPUs or a pod's TPU slices, compile only
        target = Target.for_topology(spec.compile_only_topology)
    elif spec.point.devices > jax.device_count():
        return TrialResult(
            status="crash", error=f"{spec.point.devices} devices asked, {jax.device_count()} here"
        )
    else:
        target = Target.local(spec.point.devices)
    step, result = _compile(spec.run, target, spec.memory_budget_bytes)
    if result.status != "ok":
        return result
    if spec.kind == "profile":
        profile_steps(step, spec.profile_dir)
        return dataclasses.replace(result, profile_dir=spec.profile_dir)
    if spec.kind == "compile":
        # Identical programs (every stage on one device) are timed once: see runner.py.
        fingerprint = hashlib.sha256(step.compiled.as_text().encode()).hexdigest()
        if target.runs_here:
            step.setup.compile_state_init()  # cached for the timed trial of this point, if any
        return dataclasses.replace(result, program_fingerprint=fingerprint)
    return _time(spec, step, result)


def _compile(run: RunConfig, target: Target, budget: int | None) -> tuple[Any, TrialResult]:
    """(compiled step or None, result): out-of-memory by the ZeRO formula before compiling,
    or by XLA's estimate after."""
    try:
        step = compile_for(run, target, budget, refuse_above_budget=True)
    except ModelStateTooLarge as error:
        return None, TrialResult(
            status="out-of-memory", memory_budget_bytes=budget, fits=False, error=str(error)
        )
    except (ConfigError, MeshError) as error:
        return None, TrialResult(status="compile error", error=str(error))
    except Exception as error:  # XLA's own compile failures
        return None, TrialResult(
            status=_failure_status(error, "compile error"), error=_one_line(error)
        )
    peak_bytes = step.analysis.memory_per_device.peak_estimate_bytes
    fits = budget is None or peak_bytes <= budget
    result = TrialResult(status="ok", analysis=step.analysis, memory_budget_bytes=budget, fits=fits)
    if not fits:
        result = dataclasses.replace(
            result, status="out-of-memory",
            error=f"XLA's per-device estimate {peak_bytes / 2**30:.2f} GiB exceeds the budget "
            f"{budget / 2**30:.2f} GiB",
        )  # fmt: skip
    return step, result


def _time(spec: TrialSpec, step, compiled: TrialResult) -> TrialResult:
    """Time the step until its median is known to the spec's precision (or the budget is
    spent); with a token budget (the loss objective), at least the steps it takes, and the
    loss is read there. With TrainConfig.steps_per_execution k > 1 the k-step program is
    compiled and timed (the one-step program's memory decided whether the point fits)."""
    run = step.setup.run
    tokens_per_step = run.tokens_per_step
    rule = spec.timing
    budget_steps = math.ceil(spec.token_budget / tokens_per_step) if spec.token_budget else 0
    if budget_steps:
        rule = dataclasses.replace(rule, max_samples=max(rule.max_samples, budget_steps))
    try:
        program = step
        if run.train.steps_per_execution > 1:
            program = step.setup.compile(run.train.steps_per_execution)
        measured = time_steps(program, rule, min_steps=budget_steps)
    except Exception as error:
        return dataclasses.replace(
            compiled, status=_failure_status(error, "crash"), error=_one_line(error)
        )
    steps = measured.step_time_s
    # Emulated CPU devices share one machine, so they share its one measured peak.
    peak_devices = 1 if step.setup.target.platform == "cpu" else spec.point.devices
    losses = measured.losses[: budget_steps or None]
    # The loss's evidence: its median over the last quarter of the steps (at least the samples
    # the round's comparison needs), with that median's interval.
    window = min(len(losses), max(rule.floor, len(losses) // 4))
    timing = TrialTiming(
        step_time_s=steps,
        step_times_s=measured.step_times_s,
        losses=measured.losses,
        allocator_peak_bytes=measured.allocator_peak_bytes,
        tokens_per_step=tokens_per_step,
        tokens_per_s=tokens_per_step / steps.median,
        tokens_per_s_per_device=tokens_per_step / steps.median / spec.point.devices,
        mfu=mfu(step.analysis.flops_per_step.model, steps.median, spec.peak_flops_per_s,
                peak_devices),
        final_loss=losses[-1],
        loss_interval=median_interval(losses[-window:], rule.confidence),
        loss_samples=tuple(losses[-window:]),
        tokens_seen=tokens_per_step * len(losses),
    )  # fmt: skip
    if spec.tensorboard_dir:
        _write_events(spec.tensorboard_dir, timing)
    return dataclasses.replace(compiled, timing=timing)


def _write_events(logdir: str, timing: TrialTiming) -> None:
    """The trial's steps as one TensorBoard run: loss per step, step time per sample."""
    steps = timing.step_time_s
    with ScalarWriter(logdir) as writer:
        for index, loss in enumerate(timing.losses, 1):
            writer.write(index, {"loss": loss})
        for index, seconds in enumerate(timing.step_times_s, 1):
            writer.write(index * steps.steps_per_sample, {"step_time_s": seconds})
        last = len(timing.losses)
        writer.write(last, {
            "tokens_per_s_per_device": timing.tokens_per_s_per_device, "mfu": timing.mfu,
            "step_time_s/median": steps.median, "step_time_s/low": steps.low,
            "step_time_s/high": steps.high,
        })  # fmt: skip
        if timing.allocator_peak_bytes is not None:
            writer.write(last, {"memory/allocator_peak_bytes": timing.allocator_peak_bytes})


def _failure_status(error: BaseException, otherwise: str) -> str:
    return "out-of-memory" if is_memory_refusal(error) else otherwise


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def write_result(path: Path, result: dict[str, Any]) -> None:
    """RESULT.json, complete or absent: a killed trial leaves no half result."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def main(argv: list[str]) -> int:
    spec_path, result_path = argv
    spec = json.loads(Path(spec_path).read_text())
    xla_cpu.configure_cpu_devices(int(os.environ.get("JAX_NUM_CPU_DEVICES", 1)))
    # Under a launcher (srun, several hosts) each process joins the others; one writes.
    processes = join_processes(DistributedConfig())
    xla_cpu.patch_cpu_collectives()
    if spec["kind"] == "machine":
        result = {"status": "ok"} | _machine(spec["dtype"]).to_json()
    else:
        result = _trial(TrialSpec.from_json(spec)).to_json()
    if jax.process_index() == 0:
        write_result(Path(result_path), result)
    processes.done()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
