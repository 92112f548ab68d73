"""The scaling study: real trials in real processes, the funnel, resume, failures, the report,
the planner, the cluster model and the Colab notebook.

The study, plan and notebook tests share one small grid (mt5_tiny, lengths 32/8, micro-batch 1,
stages 0 and 3 on 1 and 2 devices), so the session's compilation cache compiles each of its
programs once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, cli_inline, fake_slurm_env, read_scalars, run_cli

from t5scale.config import study_runs
from t5scale.errors import ConfigError
from t5scale.study import funnel
from t5scale.study.config import Point, StudyConfig
from t5scale.study.records import TrialRecord, TrialResult
from t5scale.study.trial import run_trial

GRID = [
    "--gin.StudyConfig.models=['mt5_tiny']",
    "--gin.StudyConfig.stages=[0, 3]",
    "--gin.StudyConfig.devices=[1, 2]",
    "--gin.StudyConfig.input_length=32",
    "--gin.StudyConfig.target_length=8",
    "--gin.StudyConfig.max_timed_steps=6",
    "--gin.StudyConfig.max_timing_s=10",
    "--gin.StudyConfig.trial_timeout_s=180",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
OBJ = "tokens_per_s_per_device"


def records(study_dir: Path) -> list[dict]:
    lines = (study_dir / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def typed(lines: list[dict]) -> list[TrialRecord]:
    """results.jsonl's lines as the study reads them."""
    return [TrialRecord.from_json(line) for line in lines]


@pytest.fixture(scope="module")
def finished_study(tmp_path_factory):
    """One funneled study of the shared grid."""
    study_dir = tmp_path_factory.mktemp("study") / "study"
    done = run_cli("study", *GRID, f"--gin.StudyConfig.study_dir={study_dir}")
    return study_dir, done


def test_quick_study_funnels_records_resumes_and_reports(finished_study):
    study_dir, done = finished_study
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ETA" in done.stdout and "study done" in done.stdout
    assert "winner for mt5_tiny: mt5_tiny stage" in done.stdout

    found = records(study_dir)
    compiled = [r for r in found if r["kind"] == "compile"]
    timed = [r for r in found if r["kind"] == "timed"]
    for r in timed:
        assert r["status"] == "ok", r
        step = r["step_time_s"]
        kept = r["step_times_s"][step["warmup_samples"] :]
        assert step["samples"] == len(kept) and step["timed_steps"] == len(kept)
        # at most 6 steps, unless its round's comparison needs more (9 here: 2 at 99.5% each)
        assert 6 <= len(r["step_times_s"]) <= 9 or step["stopped_by"] == "max_seconds"
        assert step["low"] <= step["median"] <= step["high"]
        assert step["confidence"] >= 0.95 or (len(kept) < 6 and not step["precise"])
        assert step["precise"] == (step["stopped_by"] == "precision")
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / step["median"])
        assert r["tokens_per_s_per_device"] == pytest.approx(
            r["tokens_per_s"] / r["config"]["devices"]
        )
        assert 0 < r["mfu"] < 1
        memory = r["analysis"]["memory_per_device"]
        assert memory["peak_estimate_bytes"] > 0 and r["fits"]
        assert r["allocator_peak_bytes"] is None  # the CPU reports none: null, not zero
        assert r["analysis"]["model_state_per_device"]["zero_formula_bytes"]["total"] > 0
        assert r["analysis"]["compile_time_s"] > 0
        assert r["run"] and r["machine"]["backend"] == "cpu"
    # The stages are real: their collectives differ as the table says.
    by_stage = {r["config"]["stage"]: r for r in timed if r["config"]["devices"] == 2}
    assert "all-reduce" in by_stage[0]["analysis"]["collectives"]
    assert {"all-gather", "reduce-scatter"} <= set(by_stage[3]["analysis"]["collectives"])

    # The funnel: each configuration timed in 2 trials at each device count. On 1 device every
    # stage is one program: compiled for each, timed for one, the other's trials carrying its
    # figures (and saying whose), so neither is dropped and both go on to 2 devices.
    fingerprints = {(r["config"]["devices"], r["config"]["stage"]): r["program_fingerprint"]
                    for r in compiled}  # fmt: skip
    assert fingerprints[1, 0] == fingerprints[1, 3] and fingerprints[2, 0] != fingerprints[2, 3]
    assert len(compiled) == 4 and all(r["status"] == "ok" for r in compiled)
    for devices in (1, 2):
        here = [r for r in timed if r["config"]["devices"] == devices]
        assert sorted((r["config"]["stage"], r["repeat"]) for r in here) == [
            (0, 0), (0, 1), (3, 0), (3, 1)
        ]  # fmt: skip
    by_key = {r["key"]: r for r in timed}
    reused = [r for r in timed if r.get("same_program_as")]
    assert len(reused) == 2 and {r["config"]["devices"] for r in reused} == {1}
    for record in reused:  # the twin's figures, the same repeat, of the other stage
        twin = by_key[record["same_program_as"]]
        assert (twin["repeat"], twin["step_time_s"]) == (record["repeat"], record["step_time_s"])
        assert twin["config"]["stage"] != record["config"]["stage"]
    text = (study_dir / "funnel.md").read_text()
    assert "| 1: 1 device, compile only | 2 | 2 | - | 0 | 2 |" in text
    assert "| 2: 1 device, timed | 2 | 4 | - | 0 | 2 |" in text
    assert "every ZeRO stage is the same program there" in text
    assert "| 3: 2 devices, compile only | 2 | 2 | - | 0 | 2 |" in text
    on_two = typed([r for r in timed if r["config"]["devices"] == 2])
    winner = funnel.winners(typed(timed), OBJ)["mt5_tiny"].record
    assert winner in on_two
    assert f"ZeRO stage {winner.point.stage}" in text and "saved" in text

    # TensorBoard: one run per timed trial that ran, its steps' losses and times readable by
    # TensorBoard.
    runs = sorted(p.parent for p in (study_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert len(runs) == len(timed) - len(reused)
    scalars = read_scalars(runs[0])
    assert len(scalars["loss"]) == len(
        next(r for r in timed if Path(r["tensorboard_dir"]) == runs[0])["losses"]
    )
    assert {"step_time_s", "tokens_per_s_per_device", "step_time_s/low"} <= set(scalars)

    # The report: tables and four PNG plots.
    report = (study_dir / "report.md").read_text()
    assert "| mt5_tiny | 3 | 2 |" in report and "†" in report  # † a reused timing
    for name in ("step_time", "tokens_per_device", "mfu", "memory"):
        assert (study_dir / f"{name}.png").read_bytes()[:8] == PNG_MAGIC

    # Resume: a study cut short (last record lost, a half-written line) runs only what is missing;
    # a line of bytes that are not UTF-8 is no record (a traceback before, 2026-11-29).
    lines = (study_dir / "results.jsonl").read_text().splitlines()
    damaged = "\n".join(lines[:-1]).encode() + b'\n{"status": \xff\xfe}\n{"key": "timed:mod'
    (study_dir / "results.jsonl").write_bytes(damaged)
    logs_before = len(list((study_dir / "trials").glob("*.log")))
    again = run_cli("study", *GRID, f"--gin.StudyConfig.study_dir={study_dir}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "ends in a cut line" in again.stdout
    assert f"{study_dir / 'results.jsonl'}:{len(lines)} is not a record; ignored" in again.stdout
    assert len(list((study_dir / "trials").glob("*.log"))) == logs_before + 1
    # The damaged line stays where it was, as read; taken out again for the tests that share
    # this study (the notebook's reads its records).
    text = (study_dir / "results.jsonl").read_text()
    damaged_line = text.splitlines()[len(lines) - 1]
    assert damaged_line == '{"status": \ufffd\ufffd}'
    (study_dir / "results.jsonl").write_text(text.replace(damaged_line + "\n", "", 1))
    assert {r["key"] for r in records(study_dir) if "key" in r} >= {r["key"] for r in found}


def _run_json(point: Point) -> dict:
    """The point's run as the study's parent gives it to the trial (config.study_runs)."""
    base = study_runs(StudyConfig(models=("mt5_tiny",)))["mt5_tiny"]
    run = point.run(base).to_json()
    if point.model == "mt5_tiny":
        return run
    return run | {"model": {"name": point.model}}  # a name and no dimensions: no model


def _spec(point: Point, kind: str = "compile", budget: int | None = None) -> dict:
    return {"kind": kind, "point": point.__dict__, "run": _run_json(point),
            "memory_budget_bytes": budget,
            "devices_per_process": point.devices,
            "timing": {"max_samples": 6}, "token_budget": 0, "peak_flops_per_s": 1e11}  # fmt: skip


def test_trial_statuses_timeout_out_of_memory_compile_error_crash(tmp_path):
    tiny = Point("mt5_tiny", 3, 1, "dots", 1e-3, devices=2, input_length=32, target_length=8)
    timeout = run_trial(_spec(tiny, "timed"), tmp_path, "timeout", timeout_s=0.5)
    assert timeout["status"] == "timeout" and timeout["wall_s"] < 10
    oom = run_trial(_spec(tiny, budget=1024), tmp_path, "oom", timeout_s=180)
    assert oom["status"] == "out-of-memory" and "exceeds the budget" in oom["error"]
    # 4 heads do not split over tensor=3
    bad = Point(
        "mt5_tiny", 0, 1, "dots", 1e-3, devices=6, tensor=3, input_length=32, target_length=8
    )
    error = run_trial(_spec(bad), tmp_path, "bad", timeout_s=180)
    assert error["status"] == "compile error" and "'heads' dimension" in error["error"], error
    missing = dataclasses.replace(tiny, model="mt5_missing")  # a model the trial cannot build
    crash = run_trial(_spec(missing), tmp_path, "crash", timeout_s=180)
    assert crash["status"] == "crash" and "mt5_missing" in crash["error"]


@pytest.mark.slow  # CI: the training loop's profile of chosen steps (test_cli.py), the same code
def test_a_profile_trial_traces_the_step(tmp_path):
    """StudyConfig.profile_winner runs this trial for each winner after the search."""
    point = Point("mt5_tiny", 1, 1, "auto", 1e-3, devices=2, input_length=32, target_length=8)
    spec = _spec(point, "profile", budget=2**31) | {"profile_dir": str(tmp_path / "profile")}
    result = run_trial(spec, tmp_path, "profile", timeout_s=180)
    assert result["status"] == "ok", result
    # remat is swept like any value: 'auto' records the policy it chose and the budget
    remat = result["analysis"]["remat"]
    assert remat["requested"] == "auto" and remat["policy"] == "dots"
    assert remat["budget_bytes"] == spec["memory_budget_bytes"]
    (trace,) = (tmp_path / "profile").rglob("perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = [e.get("name", "") for e in events if e.get("ph") == "X"]
    assert names.count("train") == 3 and any(n.endswith("(jit_step)") for n in names)


@pytest.mark.slow  # CI: DiLoCo's periods (test_replicas) and the plain points' trials
def test_a_diloco_point_is_timed_over_whole_rounds(tmp_path):
    point = Point("mt5_tiny", 2, 1, "dots", 1e-3, devices=4, sync="diloco/2", replicas=2,
                  input_length=32, target_length=8)  # fmt: skip
    run = point.run(study_runs(StudyConfig(models=("mt5_tiny",)))["mt5_tiny"])
    assert run.parallel.replica == 2 and run.sync.every == 2
    result = run_trial(_spec(point, "timed"), tmp_path, "diloco", 240)
    assert result["status"] == "ok", result
    assert result["analysis"]["mesh"] == {"replica": 2, "pipeline": 1, "zero": 2, "tensor": 1}
    assert result["analysis"]["replica_sync"]["inner_step"]["bytes_over_replica"] == 0
    timing = result["step_time_s"]  # each sample a round of 2 steps with its outer step
    assert timing["statistic"] == "median of periods' mean step times"
    assert timing["steps_per_sample"] == 2 and len(result["losses"]) == 12  # 6 rounds
    assert np.isfinite(result["final_loss"])


def test_a_results_line_from_before_a_rename_is_the_same_trial():
    """StudyConfig.gradient_accumulation is now micro_batches: a line that names the old field
    is read under the new name, with the key a restarted study looks for."""
    point = Point("mt5_tiny", 2, 1, "dots", 1e-3, devices=4, micro_batches=2)
    result = TrialResult(status="compile error", error="x", wall_s=1.0, log="l")
    now = TrialRecord(key=point.key("compile"), kind="compile", point=point, result=result)
    line = now.to_json()
    assert TrialRecord.from_json(json.loads(json.dumps(line))) == now
    for name in ("config", "config_point"):
        line[name]["gradient_accumulation"] = line[name].pop("micro_batches")
    fields = dataclasses.asdict(point)
    fields["gradient_accumulation"] = fields.pop("micro_batches")
    line["key"] = "compile:" + ",".join(f"{k}={v}" for k, v in sorted(fields.items()))
    assert TrialRecord.from_json(line) == now


def test_study_config_errors_are_one_line(tmp_path):
    bad = run_cli("study", "--gin.StudyConfig.stages=[5]", f"--gin.STUDY_DIR={tmp_path}")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "StudyConfig.stages: ZeRO stage must be 0, 1, 2 or 3" in bad.stderr
    with pytest.raises(ConfigError, match="remats \\['some'\\]: each must be one of dots, minimal"):
        StudyConfig(remats=("auto", "some"))
    with pytest.raises(ConfigError, match="'diloco' is not 'every_step', 'local_sgd/H' or"):
        StudyConfig(replica_syncs=("every_step", "diloco"))
    missing = run_cli("report", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "run `t5scale study`" in missing.stderr


@pytest.mark.slow  # CI: plan per stage compiled for TPU slices (test_tpu.py); the study's
# compile-only round reads the same CPU programs
def test_plan_answers_per_stage_without_running(capsys, monkeypatch):
    code, out, err = cli_inline([
        "plan", "--gin_file=gin/models/mt5_tiny.gin", "--gin.DEVICES=2",
        "--gin.DEVICE_MEMORY_GB=0.010", "--gin.PlanConfig.stages=[0, 3]",
        "--gin.INPUT_LENGTH=32", "--gin.TARGET_LENGTH=8", "--json",
    ], capsys, monkeypatch)  # fmt: skip
    assert code == 0, err[-2000:]
    plan = json.loads(out)
    zero, three = plan["stages"]
    assert zero["parameters_per_device"] == zero["parameters"]
    assert three["parameters_per_device"] < zero["parameters"] / 1.9  # sharded 2 ways (+ odd dims)
    assert three["zero_formula_bytes"]["total"] < zero["zero_formula_bytes"]["total"] / 1.9
    assert (
        three["xla_memory_per_device"]["peak_estimate_bytes"]
        < zero["xla_memory_per_device"]["peak_estimate_bytes"]
    )
    assert not zero["fits"] and three["fits"]  # 10 MB: stage 0 needs 12.8 MB, stage 3 7.6 MB
    assert "all-reduce" in zero["collectives"] and "reduce-scatter" in three["collectives"]


@pytest.mark.slow  # CI: simulate on the GPU path (test_xla_gpu.py, which also runs this CPU path
# once) and on a TPU slice (test_tpu.py); DiLoCo's periods train in CI (test_replicas.py)
def test_simulate_finds_stage_0_faster_than_3_and_diminishing_returns(
    tmp_path, capsys, monkeypatch
):
    cluster = [
        "--gin.ClusterConfig.gpus_per_node=1", "--gin.ClusterConfig.peak_flops=1e12",
        "--gin.ClusterConfig.network_bus_bandwidth=1e8", "--gin.ClusterConfig.nvlink_bus_bandwidth=1e9",
        "--gin.SimulateConfig.nodes=[1, 2]", "--gin.SimulateConfig.stages=[0, 3]",
        "--gin.SimulateConfig.micro_batch_size=1",
    ]  # fmt: skip
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, out, err = cli_inline([
        "simulate", "--gin_file=gin/models/mt5_tiny.gin", "--gin_file=gin/clusters/a100.gin",
        # Layers, not the vocabulary tables, dominate: stage 3 gathers them twice and
        # reduce-scatters once, against one all-reduce (twice the bytes) at stage 0.
        "--gin.ModelConfig.vocab_size=256",
        *cluster, "--gin.INPUT_LENGTH=32", "--gin.TARGET_LENGTH=8", "--json",
        "--gin.SimulateConfig.diloco_every=[4, 16]",
        # The CPU path, as on a machine without jax's CUDA plugin (tests/test_xla_gpu.py has
        # the GPU path's)
        "--gin.SimulateConfig.compiler='cpu'",
    ], capsys, monkeypatch)  # fmt: skip
    assert code == 0, err[-2000:]
    result = json.loads(out)["rows"]
    rows = {(r["stage"], r["nodes"]): r for r in result if r["sync"] == "every step"}
    diloco = {(r["stage"], r["sync"], r["nodes"]): r for r in result if r["sync"] != "every step"}
    for stage in (0, 3):
        # A replica per node (one GPU each here): nothing crosses the network but the outer
        # step's all-reduce, once per H steps.
        four, sixteen = diloco[stage, "DiLoCo H=4", 2], diloco[stage, "DiLoCo H=16", 2]
        assert four["communication_s"] == 0 and four["outer_step_s"] > 0
        assert four["outer_step_s"] == pytest.approx(sixteen["outer_step_s"])  # one compile
        assert rows[stage, 2]["step_s"] > four["step_s"] > sixteen["step_s"]
        assert diloco[stage, "DiLoCo H=4", 1]["outer_step_s"] < four["outer_step_s"]
    assert rows[3, 1]["communication_s"] == rows[0, 1]["communication_s"] == 0  # one GPU
    assert rows[3, 2]["communication_s"] > rows[0, 2]["communication_s"]
    assert rows[3, 2]["step_s"] > rows[0, 2]["step_s"]
    for stage in (0, 3):  # more nodes, less per GPU: one GPU needs no network
        assert rows[stage, 2]["tokens_per_s_per_device"] < rows[stage, 1]["tokens_per_s_per_device"]
    assert (tmp_path / "t5scale" / "step_analyses.json").exists()  # the next call compiles nothing


def test_colab_notebook_runs_headless(finished_study, tmp_path):
    """The notebook on the finished study's grid: it finds the trials done (the study above
    runs a missing one again on resume) and shows the report and its plots."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    study_dir = finished_study[0]
    lines = (study_dir / "results.jsonl").read_text().splitlines()
    notebook = nbformat.read(REPO / "notebooks" / "t5scale_colab.ipynb", as_version=4)
    index = next(
        i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", [])
    )
    reduced = nbformat.v4.new_code_cell(
        f"STUDY_DIR = {str(study_dir)!r}\nMODELS = ['mt5_tiny']\n"
        "STAGES = [0, 3]\nDEVICES = [1, 2]\nINPUT_LENGTH, TARGET_LENGTH = 32, 8\nMAX_TIMED_STEPS = 8"
    )
    notebook.cells.insert(index + 1, reduced)  # as papermill injects parameters
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()  # fmt: skip
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) == 4
    assert len(records(study_dir)) == len(lines)  # nothing ran again
    text = "".join(o.get("text", "") for o in outputs)
    assert "backend: cpu" in text and "trials in" in text


@pytest.mark.slow  # out of CI's budget
def test_trials_across_hosts_run_under_the_launcher(tmp_path):
    """A 4-device trial on 2 'hosts' of 2 devices: two processes under a stand-in srun."""
    env = fake_slurm_env(tmp_path) | {"SLURM_JOB_ID": "7"}
    study_dir = tmp_path / "study"
    done = run_cli(
        "study", *GRID, "--gin.StudyConfig.stages=[3]", "--gin.StudyConfig.devices=[4]",
        "--gin.StudyConfig.search='grid'", "--gin.StudyConfig.devices_per_host=2",
        "--gin.StudyConfig.repeats=1",
        "--gin.StudyConfig.trial_launcher='env SLURM_NTASKS={hosts} srun --nodes={hosts}'",
        f"--gin.StudyConfig.study_dir={study_dir}", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = records(study_dir)
    assert record["status"] == "ok", record
    assert record["analysis"]["devices"] == 4 and record["analysis"]["mesh"]["zero"] == 4
    log = Path(record["log"]).read_text()
    assert "process 1/2 (slurm)" in log


@pytest.mark.slow  # out of CI's budget
def test_the_loss_objective_keeps_the_learning_rate_that_learns(tmp_path):
    """Two learning rates, the same token budget: the one that lowers the loss goes on."""
    study_dir = tmp_path / "study"
    done = run_cli(
        "study", *GRID, "--gin.StudyConfig.stages=[0]", "--gin.StudyConfig.objective='loss'",
        "--gin.StudyConfig.devices=[2, 4]", "--gin.StudyConfig.learning_rates=[1e-6, 3e-3]", "--gin.StudyConfig.token_budget=800",
        "--gin.StudyConfig.extra_bindings=['OptimizerConfig.warmup_steps=1']",
        f"--gin.StudyConfig.study_dir={study_dir}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    timed = [r for r in records(study_dir) if r["kind"] == "timed"]
    on_two = {r["config"]["learning_rate"]: r for r in timed if r["config"]["devices"] == 2}
    assert on_two[1e-6]["tokens_seen"] == on_two[3e-3]["tokens_seen"] >= 800
    assert on_two[3e-3]["final_loss"] < on_two[1e-6]["final_loss"]
    assert {r["config"]["learning_rate"] for r in timed if r["config"]["devices"] == 4} == {3e-3}


@pytest.mark.slow  # out of CI's budget: test_a_diloco_point_is_timed_over_whole_rounds in CI
def test_the_study_sweeps_synchronisation_beside_stages_on_the_same_tokens(tmp_path):
    """Synchronous ZeRO-2 against DiLoCo (H = 4, 2 replicas, ZeRO-2 inside) with the loss
    objective: both see the same tokens, and the funnel ranks them by the loss they reach."""
    study_dir = tmp_path / "study"
    done = run_cli(
        "study", *GRID, "--gin.StudyConfig.stages=[2]", "--gin.StudyConfig.objective='loss'",
        "--gin.StudyConfig.replica_syncs=['every_step', 'diloco/4']",
        "--gin.StudyConfig.token_budget=2000", "--gin.StudyConfig.learning_rates=[3e-3]",
        "--gin.StudyConfig.devices=[4]",  # one round: both are timed, whichever learns worse
        "--gin.StudyConfig.extra_bindings=['OptimizerConfig.warmup_steps=1']",
        f"--gin.StudyConfig.study_dir={study_dir}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    timed = [r for r in records(study_dir) if r["kind"] == "timed" and r["status"] == "ok"]
    on_four = {r["config"]["sync"]: r for r in timed if r["config"]["devices"] == 4}
    assert set(on_four) == {"every_step", "diloco/4"}
    sync, diloco = on_four["every_step"], on_four["diloco/4"]
    assert sync["tokens_seen"] == diloco["tokens_seen"] >= 2000
    assert diloco["analysis"]["mesh"] == {"replica": 2, "pipeline": 1, "zero": 2, "tensor": 1}
    assert diloco["step_time_s"]["statistic"] == "median of periods' mean step times"
    winner = (study_dir / "funnel.md").read_text().split("## Winner")[1]
    best = min((sync, diloco), key=lambda r: r["final_loss"])
    words = {id(sync): "synchronised every step", id(diloco): "diloco every 4 steps over 2"}
    assert words[id(best)] in winner


def test_the_grid_gains_pipelines_with_the_stages_they_allow():
    study = StudyConfig(stages=(0, 1, 2, 3), pipelines=(1, 2), micro_batches=2)
    grid = {(c.stage, c.pipeline) for c in study.configurations()}
    assert grid == {(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (1, 2)}
    point = study.point(next(c for c in study.configurations() if c.pipeline == 2), 8)
    run = point.run(study_runs(study)["mt5_tiny"])
    assert run.parallel.pipeline == 2 and run.train.micro_batches == 2
    assert point.batch_size == run.train.batch_size == 1 * 4 * 2  # 4 data-parallel devices
    assert "_pp2/" in point.run_name() and "pipeline" not in Point.from_json(
        {**point.as_dict(), "pipeline": 1}
    ).key("timed")
    with pytest.raises(ConfigError, match="divide micro_batches=1"):
        StudyConfig(pipelines=(1, 2))


@pytest.mark.slow  # CI: the pipeline's numerics and plan (test_pipeline), the plain trials
def test_a_pipelined_point_is_compiled_and_timed_in_a_trial(tmp_path):
    point = Point("mt5_tiny", 1, 1, "dots", 1e-3, devices=4, pipeline=2, micro_batches=2,
                  input_length=32, target_length=8)  # fmt: skip
    result = run_trial(_spec(point, "timed"), tmp_path, "pipeline", 240)
    assert result["status"] == "ok", result
    assert result["analysis"]["mesh"] == {"replica": 1, "pipeline": 2, "zero": 2, "tensor": 1}
    assert result["analysis"]["collectives"]["collective-permute"]["count"] > 0
    assert np.isfinite(result["final_loss"])


def _trial_processes(study_dir: Path) -> list[int]:
    """The pids of the processes whose command line names `study_dir` (its trials)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if str(study_dir).encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
    return pids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the trials' processes in /proc")
def test_ctrl_c_in_a_study_kills_its_trials_and_records_none_half_done(tmp_path):
    """Each trial runs in a session of its own, which the terminal's Ctrl-C does not reach:
    before (2026-11-29), the study's process waited for its running trials and ran its queued
    ones, and a trial it stopped would have been recorded as crashed (and never run again)."""
    study_dir = tmp_path / "study"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    process = subprocess.Popen(
        [sys.executable, "-m", "t5scale.cli", "study", *GRID,
         f"--gin.StudyConfig.study_dir={study_dir}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list((study_dir / "trials").glob("*-compile.spec.json")):  # a compile trial runs
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    time.sleep(1.0)
    assert _trial_processes(study_dir)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == (
        f"t5scale: interrupted (Ctrl-C): the finished trials are in {study_dir}/results.jsonl, "
        "and the same command goes on from them"
    )
    assert "study done" not in out
    time.sleep(0.5)
    assert _trial_processes(study_dir) == []
    lines = records(study_dir) if (study_dir / "results.jsonl").exists() else []
    assert all(line["status"] == "ok" for line in lines if "key" in line), lines
