"""Run a study: isolated trials over the grid, funnel rounds, results.jsonl, funnel.md.

results.jsonl holds one JSON object per finished trial (compile-only or timed). A study started
again over the same STUDY_DIR reads it first and skips every trial it finds there, so the
rounds replay the same decisions and only the missing trials run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from t5scale.analysis.memory import cpu_memory_budget
from t5scale.errors import ConfigError
from t5scale.model.sizes import ModelConfig
from t5scale.study import funnel, funnel_report
from t5scale.study.config import Point, StudyConfig
from t5scale.study.evidence import TimingRule
from t5scale.study.records import Machine, TrialRecord, TrialSpec, parse_results
from t5scale.study.trial import allow_trials, run_spec, run_trial, stop_trials
from t5scale.train.config import RunConfig
from t5scale.whatif.hardware import Hardware


class Results:
    """results.jsonl: read once, appended one flushed line per finished trial."""

    def __init__(self, path: Path):
        self.path = path
        # errors="replace": bytes that are not UTF-8 make their line no record (ignored below)
        text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
        if text and not text.endswith("\n"):
            # A line cut by a kill mid-write: cut it off, so that appends start a fresh line.
            print(f"study: {path} ends in a cut line; its trial runs again", flush=True)
            text = text[: text.rfind("\n") + 1]
            path.write_text(text, encoding="utf-8")

        def skipped(number: int) -> None:
            print(f"study: {path}:{number} is not a record; ignored", flush=True)

        self.records: dict[str, TrialRecord] = parse_results(text, skipped)

    def add(self, record: TrialRecord) -> None:
        self.records[record.key] = record
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record.to_json()) + "\n")


@dataclasses.dataclass(frozen=True)
class StudySummary:
    """What a finished study found, as funnel.md shows it and the CLI prints it."""

    rounds: list[funnel.Round]
    winners: dict[str, TrialRecord]  # by model
    tied: dict[str, tuple[TrialRecord, ...]]  # by model: those the winner is not known to beat
    spent_wall_s: float  # the trials' wall time
    spent_device_s: float  # the same, times the devices of each trial
    # funnel_report.full_grid_estimate: (wall s, device s) that timing every point would cost;
    # None for a grid search, which timed every point
    full_grid: tuple[float, float] | None
    trials: int
    completed: int  # trials whose status is ok
    elapsed_s: float

    def lines(self, study_dir: str) -> list[str]:
        """What the CLI says when the study is done."""
        lines = [f"study done: {self.trials} trials in {self.elapsed_s / 60:.1f} min; "
                 f"{study_dir}/results.jsonl, {study_dir}/funnel.md"]  # fmt: skip
        for model, record in sorted(self.winners.items()):
            tied = self.tied[model]
            ties = f", tied within the evidence with {len(tied)}" if tied else ""
            lines.append(f"winner for {model}: {funnel.configuration_of(record).label()} at "
                         f"{record.point.devices} devices{ties} (funnel.md)")  # fmt: skip
        return lines


class Progress:
    """`[done/planned] … elapsed, ETA` lines: ETA = elapsed per trial run so far × trials left."""

    def __init__(self, planned: int, show: Callable[[str], None]):
        self.planned, self.done, self.ran, self.show = planned, 0, 0, show
        self.started = time.perf_counter()

    def replan(self, planned: int) -> None:
        self.planned = max(planned, self.done)

    def report(self, line: str, ran: bool) -> None:
        self.done += 1
        self.ran += ran
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(self.ran, 1) * (self.planned - self.done)
        self.show(
            f"[{self.done}/{self.planned}] {line}  · {_clock(elapsed)} elapsed, ETA {_clock(eta)}"
        )


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def _print(line: str) -> None:
    print(line, flush=True)


def run_study(
    config: StudyConfig,
    runs: Mapping[str, RunConfig] | None = None,
    gin_config: str = "",
    show: Callable[[str], None] = _print,
    hardware: Hardware | None = None,
) -> StudySummary:
    """Run (or finish) the study in config.study_dir; returns the summary funnel.md shows.
    `runs`: each model's run before its grid point is applied (Point.run), as the CLI reads
    them (t5scale/config.py: its gin file and the study's extra bindings); by default each
    model's size with every other setting at its default. With a cluster file's `hardware`
    the compile-only rounds compile for that many of its devices by its own compiler (a GPU
    cluster's compile target, or slices of a TPU pod's chips), its device memory the budget.
    The timed rounds run on the devices at hand."""
    for devices in config.devices if hardware is not None else ():
        hardware.target(devices)  # a ConfigError now where it cannot be had
    if runs is None:
        runs = {model: RunConfig(model=ModelConfig(name=model)) for model in config.models}
    study_dir = _study_dir(config, gin_config)
    results = Results(study_dir / "results.jsonl")
    machine = _machine(config, study_dir)
    show(
        f"study: {len(config.configurations())} configurations × devices {list(config.devices)} "
        f"on {machine.device_kind} ({machine.backend}); peak "
        f"{machine.peak_flops_per_s / 1e12:.3g} TFLOP/s ({machine.peak_source})"
    )
    configurations = config.configurations()
    devices = sorted(config.devices)
    progress = Progress(_planned(len(configurations), devices, config), show)
    runner = _TrialRunner(config, runs, study_dir, results, machine, progress, hardware)
    if hardware is not None:
        show(f"compile-only rounds: {hardware.compile_only_words()}, "
             f"{hardware.device_memory_gb:g} GB each")  # fmt: skip
    found = funnel.search(
        configurations,
        devices,
        runner,
        config.objective,
        config.search == "funnel",
        config.confidence,
    )
    best = funnel.winners(found.timed_records, config.objective, config.confidence)
    if config.profile_winner:
        _profile_winners(best, runner, show)
    return _summary(config, found, best, study_dir, progress.started)


def _summary(
    config: StudyConfig, found: funnel.Search, best: Mapping[str, funnel.Winner],
    study_dir: Path, started: float,
) -> StudySummary:  # fmt: skip
    """What the study spent and found, written to funnel.md too."""
    compile_records, timed_records = found.compile_records, found.timed_records
    records = compile_records + timed_records
    spent_wall = sum(r.wall_s for r in records)
    spent_device = sum(r.wall_s * r.point.devices for r in records)
    full = None
    if config.search == "funnel":
        grid = [config.point(c, d) for c in config.configurations() for d in sorted(config.devices)]
        full = funnel_report.full_grid_estimate(
            grid, compile_records, timed_records, config.repeats
        )
    text = funnel_report.render(
        found.rounds, best, config.objective, (spent_wall, spent_device), full
    )
    (study_dir / "funnel.md").write_text(text, encoding="utf-8")
    return StudySummary(
        rounds=found.rounds,
        winners={model: winner.record for model, winner in best.items()},
        tied={model: tuple(r for r, _ in winner.tied) for model, winner in best.items()},
        spent_wall_s=spent_wall,
        spent_device_s=spent_device,
        full_grid=full,
        trials=len(records),
        completed=sum(r.result.status == "ok" for r in records),
        elapsed_s=time.perf_counter() - started,
    )


def _study_dir(config: StudyConfig, gin_config: str) -> Path:
    """The study's directory, made, with the gin configuration it was started with."""
    study_dir = Path(config.study_dir)
    try:
        study_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file there, or no permission
        raise ConfigError(f"StudyConfig.study_dir {str(study_dir)!r}: {error.strerror}") from None
    if gin_config:
        (study_dir / "study.gin").write_text(gin_config, encoding="utf-8")
    return study_dir


def _profile_winners(
    best: Mapping[str, funnel.Winner], runner: _TrialRunner, show: Callable[[str], None]
) -> None:
    for model, winner in sorted(best.items()):
        record, _ = runner.run_one(winner.record.point, "profile", "profile of the winner")
        show(f"profile of {model}'s winner: {record.result.profile_dir or record.result.status}")


def _planned(alive: int, devices: Sequence[int], config: StudyConfig) -> int:
    """Trials still ahead if every configuration still in went on (an upper bound, for the
    ETA: the funnel drops what the evidence shows worse)."""
    return alive * len(devices) * (config.repeats + (config.search == "funnel"))


def _machine(config: StudyConfig, study_dir: Path) -> Machine:
    """The backend, its peak FLOP/s and memory: probed once per study, in a child process."""
    path = study_dir / "machine.json"
    if path.exists():
        return Machine.from_json(json.loads(path.read_text()))
    result = run_trial(
        {"kind": "machine", "dtype": config.dtype, "devices_per_process": 1},
        study_dir / "trials", "machine", 300,
    )  # fmt: skip
    if result["status"] != "ok":
        raise RuntimeError(f"could not probe the machine: {result.get('error')} ({result['log']})")
    path.write_text(json.dumps(result, indent=2) + "\n")
    return Machine.from_json(result)


class _TrialRunner:
    """funnel.Trials as isolated processes, recorded in results.jsonl."""

    def __init__(
        self, config: StudyConfig, runs: Mapping[str, RunConfig], study_dir: Path,
        results: Results, machine: Machine, progress: Progress,
        hardware: Hardware | None = None,
    ):  # fmt: skip
        self.config, self.runs, self.study_dir, self.results = config, runs, study_dir, results
        self.machine, self.progress, self.hardware = machine, progress, hardware
        self.min_samples = 0
        # numbered after every trial this study dir has seen, so that no log is overwritten
        self.counter = len(list((study_dir / "trials").glob("0*.spec.json")))
        self._counting = threading.Lock()

    def budget(self, devices: int) -> int | None:
        if self.config.device_memory_gb is not None:
            return int(self.config.device_memory_gb * 2**30)
        if self.machine.backend == "cpu":
            return cpu_memory_budget(self.machine.host_memory_bytes, devices)
        return self.machine.device_memory_limit_bytes

    def hosts(self, devices: int) -> int:
        per_host = self.config.devices_per_host
        return max(1, devices // per_host) if self.config.trial_launcher else 1

    def launcher(self, devices: int) -> list[str]:
        """The launcher's command for a trial on `devices`, if it spans several hosts."""
        hosts = self.hosts(devices)
        if hosts == 1:
            return []
        return shlex.split(self.config.trial_launcher.format(hosts=hosts, devices=devices))

    def spec(self, point: Point, kind: str, repeat: int = 0) -> TrialSpec:
        study = self.config
        run_name = point.run_name() + (f"_trial{repeat + 1}" if repeat else "")
        if kind == "compile" and self.hardware is not None:
            devices = point.devices
            return TrialSpec(
                kind=kind, point=point, run=self.run_of(point, self.hardware.dcn_groups(devices)),
                memory_budget_bytes=self.hardware.memory_budget_bytes,
                compile_only_topology=self.hardware.topology(devices),
            )  # fmt: skip
        return TrialSpec(
            kind=kind,
            point=point,
            run=self.run_of(point),
            devices_per_process=point.devices // self.hosts(point.devices),
            memory_budget_bytes=self.budget(point.devices),
            timing=TimingRule(
                precision=study.timing_precision, min_samples=self.min_samples,
                max_samples=study.max_timed_steps, max_seconds=study.max_timing_s,
            ),
            token_budget=study.token_budget if study.objective == "loss" else 0,
            peak_flops_per_s=self.machine.peak_flops_per_s,
            # one TensorBoard run per timed trial, so that trials compare in one TensorBoard
            tensorboard_dir=str(self.study_dir / "tensorboard" / run_name)
            if kind == "timed" else None,
            profile_dir=str(self.study_dir / "profile" / point.run_name()),
        )  # fmt: skip

    def run_of(self, point: Point, dcn_groups: int = 1) -> RunConfig:
        return point.run(self.runs[point.model], dcn_groups)

    def run_one(
        self, point: Point, kind: str, round_name: str, repeat: int = 0
    ) -> tuple[TrialRecord, bool]:
        """(record, whether it ran now): a trial found in results.jsonl is not run again."""
        key = point.key(funnel.timed_kind(repeat) if kind == "timed" else kind)
        if key in self.results.records:
            return self.results.records[key], False
        if kind == "timed" and (twin := self._timed_twin(point, repeat)):
            # The same compiled program (e.g. every stage on one device) runs the same steps:
            # its timing is reused rather than measured again, and says so.
            record = dataclasses.replace(
                twin, key=key, round_name=round_name, point=point, same_program_as=twin.key,
                run=self.run_of(point),
                result=dataclasses.replace(twin.result, wall_s=0.0), measured_wall_s=twin.wall_s,
            )  # fmt: skip
            self.results.add(record)
            return record, False
        with self._counting:  # compile-only trials run in threads: each its own name
            self.counter += 1
            name = f"{self.counter:04d}-{kind}"
        spec = self.spec(point, kind, repeat)
        result = run_spec(
            spec, self.study_dir / "trials", name,
            self.config.trial_timeout_s, self.launcher(point.devices),
        )  # fmt: skip
        record = TrialRecord(
            key=key, kind=kind, round_name=round_name, point=point, result=result,
            run=spec.run,
            machine=self.machine.label(), peak_flops_per_s=self.machine.peak_flops_per_s,
            finished_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
            tensorboard_dir=spec.tensorboard_dir, repeat=repeat,
        )  # fmt: skip
        self.results.add(record)
        return record, True

    def _timed_twin(self, point: Point, repeat: int) -> TrialRecord | None:
        """A timed trial (the same repeat), already run, whose compile-only trial produced this
        point's program."""
        fingerprint = self._fingerprint(point)
        if fingerprint is None:
            return None
        for record in self.results.records.values():
            if (
                record.kind == "timed"
                and record.same_program_as is None
                and record.repeat == repeat
                and record.result.status == "ok"
                and self._fingerprint(record.point) == fingerprint
            ):
                return record
        return None

    def _fingerprint(self, point: Point) -> str | None:
        compiled = self.results.records.get(point.key("compile"))
        return compiled.result.program_fingerprint if compiled else None

    def compile(self, configurations, devices: int, name: str) -> list[TrialRecord]:
        return self.run_all(
            [self.config.point(c, devices) for c in configurations], "compile", name
        )

    def time(self, configurations, devices: int, name: str) -> list[TrialRecord]:
        """Each configuration in `repeats` trials, the rounds of trials in alternating order
        (forwards, backwards) so that a machine whose speed drifts favours none."""
        # With one trial each, enough steps that each trial's interval can take part in the
        # round's comparison; with repeats, the comparison is of the trials' medians.
        self.min_samples = 0
        if self.config.repeats == 1:
            self.min_samples = funnel.samples_to_compare(self.config.confidence, configurations)
        points = [self.config.point(c, devices) for c in configurations]
        records, repeats = [], self.config.repeats
        for repeat in range(repeats):
            order = points if repeat % 2 == 0 else points[::-1]
            label = f"{name} {repeat + 1}/{repeats}" if repeats > 1 else name
            records += self.run_all(order, "timed", label, repeat)
        return records

    def ahead(self, alive: int, devices: Sequence[int]) -> None:
        self.progress.replan(self.progress.done + _planned(alive, devices, self.config))

    def run_all(
        self, points: list[Point], kind: str, round_name: str, repeat: int = 0
    ) -> list[TrialRecord]:
        """Compile-only trials run `compile_workers` at a time; timed trials one by one."""
        workers = 1
        if kind == "compile":
            workers = self.config.compile_workers or (
                os.cpu_count() or 1 if self.machine.backend == "cpu" else 1
            )
        records: list[TrialRecord] = []
        allow_trials()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(self.run_one, p, kind, round_name, repeat) for p in points]
            try:
                for point, future in zip(points, futures, strict=True):
                    record, ran = future.result()
                    records.append(record)
                    self.progress.report(
                        f"{round_name}: {point.configuration.label()} × {point.devices}: "
                        f"{_outcome(record)}",
                        ran,
                    )
            except BaseException:  # Ctrl-C: no trial left running or queued, none recorded
                pool.shutdown(wait=False, cancel_futures=True)
                stop_trials()
                raise
        return records


def _outcome(record: TrialRecord) -> str:
    result = record.result
    if result.status != "ok":
        return f"{result.status} ({result.error or ''})"
    analysis = result.analysis
    memory = analysis.memory_per_device.peak_estimate_bytes / 2**30
    if record.kind == "compile":
        remat = analysis.remat
        chosen = f" with remat {remat.policy}" if remat.requested == "auto" else ""
        return f"fits{chosen}, {memory:.2f} GiB/device, compiled in {analysis.compile_time_s:.1f} s"
    timing = result.timing
    return (
        f"{timing.step_time_s.median:.3g} s/step, "
        f"{timing.tokens_per_s_per_device:,.0f} tokens/s/device, MFU {100 * timing.mfu:.1f}%"
    )
