"""Bad input to the study side (StudyConfig, PlanConfig, SimulateConfig, ClusterConfig, the
report, the runner, the trial launcher) is one ConfigError naming the field and the value, raised
before any trial runs: no traceback, no trial that fails for the grid's sake, no silent fallback.
Unit tests only, each in milliseconds (the CLI turns a ConfigError into its one line, exit 2)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from t5scale.config import study_runs
from t5scale.errors import ConfigError
from t5scale.model.sizes import ModelConfig
from t5scale.study.config import Point, StudyConfig
from t5scale.study.records import TrialRecord, TrialResult, parse_results
from t5scale.study.report import write_report
from t5scale.study.runner import run_study
from t5scale.study.trial import run_trial
from t5scale.train.config import RunConfig
from t5scale.whatif.gpu_cluster import ClusterConfig
from t5scale.whatif.plan import PlanConfig
from t5scale.whatif.simulate import SimulateConfig, simulate


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"models": "mt5_tiny"}, "StudyConfig.models must be a list of strings, got 'mt5_tiny'"),
        ({"extra_bindings": "A=1"}, "StudyConfig.extra_bindings must be a list of strings"),
        ({"devices": ["one"]}, r"StudyConfig.devices must be a list of integers, got \['one'\]"),
        ({"learning_rates": ["fast"]}, "StudyConfig.learning_rates must be a list of numbers"),
        ({"replicas": True}, "StudyConfig.replicas must be an integer, got True"),
        ({"profile_winner": "no"}, "StudyConfig.profile_winner must be True or False, got 'no'"),
        ({"models": ["mt5_nope"]}, r"StudyConfig.models \['mt5_nope'\]: each must be a size"),
        ({"micro_batch_sizes": [0]}, r"StudyConfig.micro_batch_sizes \[0\]: each must be >= 1"),
        ({"micro_batch_sizes": [-1]}, r"StudyConfig.micro_batch_sizes \[-1\]"),
        ({"micro_batches": 0}, "StudyConfig.micro_batches must be >= 1, got 0"),
        ({"input_length": 1}, "StudyConfig.input_length and target_length must be >= 2, got 1"),
        ({"dtype": "float16"}, "StudyConfig.dtype must be one of float32, bfloat16, got 'float16'"),
        ({"precision": "half"}, "StudyConfig.precision: .*'half'"),
        ({"precision": "fp8"}, "StudyConfig.precision: .*'fp8' runs the rest of the model in bf16"),
        ({"optimizer": "adam"}, "StudyConfig.optimizer: .*'adam'"),
        ({"data_source": "wiki"}, "StudyConfig.data_source: .*'wiki'"),
        ({"tensor": 0}, "StudyConfig.tensor must be >= 1, got 0"),  # was ZeroDivisionError
        ({"tensor": -1}, "StudyConfig.tensor must be >= 1, got -1"),
        # a mesh of tensor alone: XLA's SPMD partitioner cannot compile the step
        ({"tensor": 2, "devices": [2, 4]}, r"StudyConfig.devices \[2\]: with tensor=2 each must"),
        ({"device_memory_gb": 0}, "StudyConfig.device_memory_gb must be None or > 0, got 0"),
        ({"device_memory_gb": -1.0}, "StudyConfig.device_memory_gb must be None or > 0"),
        ({"learning_rates": [0]}, r"StudyConfig.learning_rates \[0\]: each must be > 0"),
        ({"remats": ["dots", "none"]}, "StudyConfig.remats: ModelConfig.remat 'none' is now"),
        ({"compile_workers": -1}, "StudyConfig.compile_workers must be >= 0"),
        ({"extra_bindings": ["nothing"]}, r"extra_bindings \['nothing'\]: each must be NAME=VALUE"),
        ({"extra_bindings": ["A.b="]}, r"extra_bindings \['A.b='\]: each must be NAME=VALUE"),
        # the grid's own settings: each trial's point would replace it without a word
        ({"extra_bindings": ["ModelConfig.remat='full'"]}, "ModelConfig.remat is set by the grid"),
        ({"extra_bindings": ["BATCH_SIZE=64"]}, "BATCH_SIZE is set by the grid: give it as "),
        (
            {"trial_launcher": "no-such-launcher --nodes={hosts}"},
            "StudyConfig.trial_launcher .*'no-such-launcher' is not on PATH",
        ),
        ({"trial_launcher": "srun --n={nodes}"}, "StudyConfig.trial_launcher .*KeyError"),
        ({"trial_launcher": "srun 'open"}, "StudyConfig.trial_launcher .*quotation"),
    ],
)
def test_study_config_refuses_what_no_trial_could_run(fields, message):
    with pytest.raises(ConfigError, match=message):
        StudyConfig(**fields)


def test_study_config_takes_gin_lists_and_a_launcher_on_path():
    config = StudyConfig(models=["mt5_tiny"], learning_rates=[1, 3e-3], trial_launcher="env")
    assert config.models == ("mt5_tiny",) and config.learning_rates == (1, 3e-3)


def test_an_fp8_study_runs_its_trials_with_fp8_matmuls():
    """StudyConfig.precision 'fp8' (bf16 compute): each trial's run has the FP8 matmuls."""
    config = StudyConfig(models=["mt5_tiny"], precision="fp8", dtype="bfloat16")
    point = config.point(config.configurations()[0], 2)
    run = point.run(study_runs(config)["mt5_tiny"])
    assert run.precision.mode == "fp8" and run.model.fp8_amax_history == 1024


def test_a_study_dir_that_is_a_file_is_one_error(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ConfigError, match="StudyConfig.study_dir .*afile' is not a directory"):
        StudyConfig(study_dir=str(afile))
    # below a file: found where the runner makes it, before any trial
    with pytest.raises(ConfigError, match="StudyConfig.study_dir .*afile/sub'"):
        run_study(StudyConfig(study_dir=str(afile / "sub")), show=lambda line: None)


def test_a_launcher_that_cannot_start_is_a_crashed_trial(tmp_path):
    result = run_trial({"kind": "compile"}, tmp_path, "t", 5, launcher=["/no/such/launcher"])
    assert result["status"] == "crash" and "cannot start the trial" in result["error"]


@pytest.mark.parametrize(
    "make, fields, message",
    [
        (PlanConfig, {"tensor": 0}, "PlanConfig.tensor must be >= 1, got 0"),
        (PlanConfig, {"tensor": -1}, "PlanConfig.tensor must be >= 1, got -1"),
        (PlanConfig, {"stages": []}, "PlanConfig.stages is empty"),
        (PlanConfig, {"stages": 2}, "PlanConfig.stages must be a list of integers, got 2"),
        (PlanConfig, {"devices": True}, "PlanConfig.devices must be an integer, got True"),
        (PlanConfig, {"devices": 8.0}, "PlanConfig.devices must be an integer, got 8.0"),
        (SimulateConfig, {"stages": []}, "SimulateConfig.stages is empty"),
        (SimulateConfig, {"nodes": [1.5]}, r"SimulateConfig.nodes must be .*, got \[1.5\]"),
        (SimulateConfig, {"overlap": "no"}, "SimulateConfig.overlap must be True or False"),
    ],
)
def test_plan_and_simulate_configs_name_their_field(make, fields, message):
    with pytest.raises(ConfigError, match=message):
        make(**fields)


def test_simulate_names_its_own_tensor_against_the_cluster():
    with pytest.raises(ConfigError, match="SimulateConfig.tensor=3 must divide ClusterConfig"):
        simulate(None, _cluster(), SimulateConfig(tensor=3, nodes=(1,)))


def _cluster(**fields) -> ClusterConfig:
    figures = dict(name="test", gpu="NVIDIA A100", gpus_per_node=8, gemm_efficiency=0.8,
                   attention_efficiency=0.1,
                   memory_bandwidth=2e12, memory_efficiency=0.8, roofline_fraction=0.5,
                   device_memory_gb=80, nvlink_bus_bandwidth=2e11, network_bus_bandwidth=1e11,
                   nvlink_latency_s=1e-6, network_latency_s=5e-6, collective_launch_s=1e-5)  # fmt: skip
    return ClusterConfig(**figures | fields)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"gpus_per_node": 8.0}, "ClusterConfig.gpus_per_node must be an integer, got 8.0"),
        ({"gpus_per_node": True}, "ClusterConfig.gpus_per_node must be an integer, got True"),
        ({"nvlink_latency_s": "fast"}, "ClusterConfig.nvlink_latency_s must be a number"),
        ({"name": 5}, "ClusterConfig.name must be a string, got 5"),
    ],
)
def test_cluster_config_checks_each_figures_type(fields, message):
    assert _cluster().peak_flops > 0  # the datasheet's
    with pytest.raises(ConfigError, match=message):
        _cluster(**fields)


def _failed_line(status: str = "crash") -> dict:
    config = {"model": "mt5_tiny", "stage": 0, "micro_batch_size": 1, "remat": "dots",
              "learning_rate": 1e-3, "devices": 2}  # fmt: skip
    return {"key": f"timed:{status}", "kind": "timed", "config": config, "status": status}


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], r"\(0 records\)"),
        (["not json", "{", "[1, 2]"], r"\(0 records; lines 1, 2, 3 are not records\)"),
        ([json.dumps({"status": "ok"})], r"\(0 records; line 1 is not a record\)"),  # no kind
        ([json.dumps({k: v for k, v in _failed_line("ok").items() if k != "config"})], "line 1"),
        ([json.dumps(_failed_line() | {"config": [1]})], "line 1 is not a record"),
        ([json.dumps(_failed_line()), json.dumps(_failed_line("timeout"))], r"\(2 records\)"),
    ],
)
def test_a_report_without_a_completed_trial_is_one_error(tmp_path, lines, message):
    (tmp_path / "results.jsonl").write_text("".join(line + "\n" for line in lines))
    with pytest.raises(
        ConfigError,
        match=re.escape(f"{tmp_path}/results.jsonl: no completed trial to report ")
        + ".*"
        + message,
    ):
        write_report(tmp_path)


def test_a_report_of_a_study_dir_that_is_a_file_is_one_error(tmp_path):
    (tmp_path / "results.jsonl").mkdir()
    with pytest.raises(ConfigError, match="does not exist: run `t5scale study`"):
        write_report(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        write_report(Path(tmp_path, "nothing"))


def test_an_ok_line_without_its_timing_is_left_out_of_the_plots(tmp_path):
    """status ok, but no analysis or timing (written by hand): the report is still written."""
    lines = [json.dumps(_failed_line("ok")), "garbage", json.dumps(_failed_line())]
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    report = write_report(tmp_path).read_text()
    assert "Trials that did not run (1)" in report
    assert "1 line of results.jsonl is not a record" in report and "(line 2)" in report


def test_cluster_replace_keeps_checking():
    with pytest.raises(ConfigError, match="gpus_per_node must be >= 1, got 0"):
        dataclasses.replace(_cluster(), gpus_per_node=0)


def test_a_results_line_from_before_dots_was_named_so_is_the_same_trial():
    """remat 'none' is now 'dots': a results.jsonl line written before reads as 'dots', its
    run too, with the key the trial has now (so that a restarted study skips it)."""
    point = Point("mt5_tiny", 2, 1, "dots", 1e-3, devices=4)
    result = TrialResult(status="compile error", error="x", wall_s=1.0, log="l")
    now = TrialRecord(key=point.key("compile"), kind="compile", point=point, result=result,
                      run=RunConfig(model=ModelConfig(remat="dots")))  # fmt: skip
    line = json.loads(json.dumps(now.to_json()))
    for name in ("config", "config_point"):
        line[name]["remat"] = "none"
    line["run"]["model"]["remat"] = "none"
    line["key"] = line["key"].replace("remat=dots", "remat=none")
    assert TrialRecord.from_json(line) == now
    assert list(parse_results(json.dumps(line) + "\n")) == [point.key("compile")]
    del line["config_point"]  # the oldest lines: the point as `config` alone
    assert TrialRecord.from_json(line) == now
