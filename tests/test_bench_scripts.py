"""Every bench script run in a small mode (issue 61, point 8): its own code path end to end, at
sizes that take seconds, so that none rots between the runs that fill docs/. Each test reads
what the script wrote (its table, JSON or plot), not only its exit status. bench/gpu_check.py's
dry run is tests/test_gpu_check.py's; bench/same_programs.sh is the before/after tool that
bench/compare_programs.py reads, and runs whole trainings, so only the comparison runs here.
Scripts that compile real programs are `-m slow`."""

import importlib
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from t5scale.startup import cuda_plugin_installed, libtpu_installed

BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))  # the scripts' own modules, as a script has them
compare_programs = importlib.import_module("compare_programs")

needs_gpu_compiler = pytest.mark.skipif(
    not cuda_plugin_installed(), reason="XLA:GPU compile-only: jax's CUDA plugin (the test extra)"
)
needs_libtpu = pytest.mark.skipif(not libtpu_installed(), reason="libtpu: the tpu extra (Linux)")


def run_script(tmp_path, script: str, *arguments: str) -> str:
    """The script's stdout, run from the repository (its gin paths are relative) with its
    analysis cache in tmp_path, so that it compiles what it reports."""
    environment = dict(
        os.environ,
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *arguments],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of each markdown table row whose first cell is `first_cell`."""
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if "|" in line]
    return [[cell.strip() for cell in row] for row in rows if row[0].strip() == first_cell]


# ---------------------------------------------------------------------------------------------
# Quick: no compile.


def test_compare_programs_names_each_difference_but_timings(tmp_path, capsys):
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir(), after.mkdir()
    same = {"a": 1, "compile_time_s": 2.0}
    runs = {
        "same.json": (same, same),
        "timing.json": (same, {"a": 1, "compile_time_s": 3.5}),
        "changed.json": (
            {"a": 1, "b": [1, 2], "c": {"d": "x"}, "gone": 0},
            {"a": 2, "b": [1, 2, 3], "c": {"d": "y"}, "new": 0},
        ),
    }
    for name, (old, new) in runs.items():
        (before / name).write_text(json.dumps(old))
        (after / name).write_text(json.dumps(new))
    compare_programs.main(str(before), str(after))
    assert capsys.readouterr().out.splitlines() == [
        "changed.json: 5 differences besides compile_time_s",
        "    .a: 1 -> 2",
        "    .b: 2 items -> 3",
        "    .c.d: 'x' -> 'y'",
        "    .gone: removed",
        "    .new: added",
        "same.json: byte-identical",
        "timing.json: 0 differences besides compile_time_s",
    ]


def test_funnel_noise_writes_a_row_per_noise_and_its_plot(tmp_path):
    out = tmp_path / "funnel.json"
    args = ["--runs", "2", "--grid-runs", "1", "--step-noises", "0.1", "--out", str(out)]
    printed = run_script(tmp_path, "funnel_noise.py", *args)
    rows = json.loads(out.read_text())
    funnel_noise = importlib.import_module("funnel_noise")
    assert [(r["step_noise"], r["trial_noise"]) for r in rows] == [
        (0.1, trial) for trial in funnel_noise.TRIAL_NOISES
    ]
    for row in rows:
        assert row["runs"] == 2 and 0 <= row["best_won"] <= row["best_survived"] <= 1
        assert row["saving_min"] <= row["saving_mean"] <= row["saving_max"] < 1
    assert out.with_suffix(".png").stat().st_size > 0 and f"wrote {out}" in printed


def test_the_zero_across_slices_plot_redraws_the_committed_figures(tmp_path):
    out = tmp_path / "plot.png"
    data = REPO / "docs" / "tpu_zero_across_slices.json"
    printed = run_script(tmp_path, "tpu_zero_across_slices_plot.py", "--data", str(data),
                         "--out", str(out))  # fmt: skip
    assert printed.strip() == str(out) and out.read_bytes()[:4] == b"\x89PNG"


def test_bench_checkpoint_saves_and_restores_mt5_tiny(tmp_path):
    printed = run_script(tmp_path, "bench_checkpoint.py", "--models", "mt5_tiny", "--devices",
                         "2", "--stage", "3", "--repeats", "1", "--dir", str(tmp_path / "ckpt"))  # fmt: skip
    (row,) = table_rows(printed, "mt5_tiny")
    parameters, size = int(row[1].replace(",", "")), float(row[2].split()[0])
    assert parameters > 0 and size > 0  # AdamW's state besides the parameters, on disk
    assert all(float(seconds) >= 0 for seconds in row[3:])
    assert list((tmp_path / "ckpt").iterdir()) == []  # each repeat's directory removed


# ---------------------------------------------------------------------------------------------
# Slow: each compiles real programs (mt5_tiny, on the CPU, for GPUs or for TPUs).


@pytest.mark.slow
def test_bench_step_times_mt5_tiny_on_one_device(tmp_path):
    out = tmp_path / "step.json"
    run_script(tmp_path, "bench_step.py", "--models", "mt5_tiny", "--steps", "6", "--repeats",
               "1", "--batch", "2", "--input-length", "32", "--target-length", "8",
               "--one-device", "--no-torch", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert (run["model"], run["devices"], run["status"]) == ("mt5_tiny", 1, "ok")
    assert run["step_s"] > 0 and run["tokens_per_s"] > 0 and run["compile_s"] > 0
    assert result["workload"]["input_length"] == 32 and result["peak_flops_per_s"] > 0


@pytest.mark.slow
def test_head_memory_compiles_the_head_tiled_and_whole(tmp_path):
    out = tmp_path / "head.json"
    printed = run_script(tmp_path, "head_memory.py", "--models", "mt5_tiny", "--remats", "dots",
                         "--chunks", "0", "auto", "--batch", "2", "--out", str(out))  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["loss_chunk_tokens"] for r in rows] == [0, None]
    assert all(r["peak_bytes"] > 0 and r["batch"] == 2 for r in rows)
    assert [row[2] for row in table_rows(printed, "mt5_tiny")] == ["whole logits", "tiled"]


@pytest.mark.slow
def test_the_cluster_model_table_and_calibration_in_small(tmp_path):
    printed = run_script(tmp_path, "cluster_model_vs_published.py", "--small")
    rows = table_rows(printed, "t5x") + table_rows(printed, "NeMo")
    assert [row[1:4] for row in rows] == [["T5 v1.1 small", "8", "1"], ["mT5 3B", "8", "2"]]
    assert all(float(row[6].replace(",", "")) > 0 for row in rows)  # predicted seq/s
    assert table_rows(printed, "all (2)")
    calibrated = run_script(tmp_path, "cluster_model_vs_published.py", "--small", "--calibrate")
    assert "cpu path: fraction" in calibrated and "(geometric mean of 1)" in calibrated


@pytest.mark.slow
@needs_gpu_compiler
def test_gpu_memory_compiles_for_gpus_and_cpus(tmp_path):
    printed = run_script(tmp_path, "gpu_memory.py", "--models", "mt5_tiny", "--nodes", "1",
                         "--stages", "1")  # fmt: skip
    (row,) = {tuple(r) for r in table_rows(printed, "mt5_tiny")}  # printed as it goes, then all
    assert row[1:3] == ("1", "1") and "GEMMs" in row[-1] and "–" not in row[5]


@pytest.mark.slow
@needs_gpu_compiler
def test_gpu_step_compiled_counts_an_h100_steps_kernels(tmp_path):
    printed = run_script(tmp_path, "gpu_step_compiled.py", "--models", "mt5_tiny",
                         "--attention", "dot", "--remat", "dots")  # fmt: skip
    (row,) = table_rows(printed, "mt5_tiny")
    assert row[1:5] == ["dot", "dots", "loop", "float32"] and int(row[7].replace(",", "")) > 0


@pytest.mark.slow
@needs_gpu_compiler
def test_remat_policies_compare_what_each_keeps(tmp_path):
    printed = run_script(tmp_path, "remat_policies_gpu.py", "mt5_tiny",
                         "dots_saveable,no_checkpoint")  # fmt: skip
    rows = table_rows(printed, "mt5_tiny")
    assert [row[2] for row in rows] == ["dots_saveable", "no_checkpoint"]
    assert all("ms" in row[10] for row in rows)  # the roofline step


@pytest.mark.slow
@needs_gpu_compiler
def test_pipeline_layouts_predict_a_point_and_plot_it(tmp_path):
    out, plot = tmp_path / "layouts.json", tmp_path / "layouts.png"
    run_script(tmp_path, "pipeline_layouts.py", "--models", "mt5_tiny", "--nodes", "1",
               "--sweep", "--out", str(out), "--plot", str(plot))  # fmt: skip
    (row,) = json.loads(out.read_text())
    assert (row["model"], row["layout"], row["gpus"]) == ("mt5_tiny", "ZeRO 3", 8)
    assert row["step_s"] > 0 and plot.stat().st_size > 0


@pytest.mark.slow
def test_seed_study_predicted_on_both_clusters(tmp_path):
    plot = tmp_path / "seed.png"
    printed = run_script(tmp_path, "seed_study_predicted.py", "--models", "mt5_tiny", "--nodes",
                         "1", "--stages", "1", "--fp8", "--plot", str(plot))  # fmt: skip
    ((_, stage, a100, h100, h100_fp8),) = table_rows(printed, "mt5_tiny")[:1]
    assert stage == "1" and all(float(cell.rstrip("*")) > 0 for cell in (a100, h100, h100_fp8))
    assert "| model | stage | A100 ×1 | H100 ×1 | H100 FP8 ×1 |" in printed
    assert plot.stat().st_size > 0


@pytest.mark.slow
def test_diloco_learning_trains_and_tabulates(tmp_path):
    out, plot = tmp_path / "diloco.json", tmp_path / "diloco.png"
    printed = run_script(tmp_path, "diloco_learning.py", "--steps", "2", "--batch_size", "8",
                         "--validate_every", "2", "--replicas", "2", "--every", "2", "--modes",
                         "diloco", "--out", str(out), "--plot", str(plot))  # fmt: skip
    runs = json.loads(out.read_text())
    assert [(r["mode"], r["replicas"], r["every"]) for r in runs] == [
        ("every_step", 2, 1), ("diloco", 2, 2)
    ]  # fmt: skip
    assert all(r["final_validation_loss"] > 0 and r["bytes_per_token"] > 0 for r in runs)
    assert len(table_rows(printed, "2")) == 2 and plot.stat().st_size > 0


@pytest.mark.slow
def test_fp8_learning_trains_both_precisions_and_tabulates(tmp_path):
    out, plot = tmp_path / "fp8.json", tmp_path / "fp8.png"
    printed = run_script(tmp_path, "fp8_learning.py", "--steps", "2", "--layers", "1",
                         "--batch_size", "8", "--validate_every", "2", "--out", str(out),
                         "--plot", str(plot))  # fmt: skip
    runs = json.loads(out.read_text())
    assert [r["precision"] for r in runs] == ["mixed", "fp8"]
    assert all(len(r["train"]) == 2 and r["final_validation_loss"] > 0 for r in runs)
    assert [row[0] for row in table_rows(printed, "mixed") + table_rows(printed, "fp8")] == [
        "mixed", "fp8"
    ]  # fmt: skip
    assert plot.stat().st_size > 0


@pytest.mark.slow
@needs_libtpu
def test_tpu_attention_compiles_each_route(tmp_path):
    printed = run_script(tmp_path, "tpu_attention.py", "--batch", "1")
    routes = [row[1] for name in ("encoder self-attention", "cross-attention")
              for row in table_rows(printed, name)]  # fmt: skip
    assert routes == ["dot", "jax TPU flash", "t5scale TPU"] * 2


@pytest.mark.slow
@needs_libtpu
def test_tpu_collective_bytes_beside_the_formula(tmp_path):
    out = tmp_path / "bytes.json"
    run_script(tmp_path, "tpu_collective_bytes.py", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert sorted({r["stage"] for r in rows}) == [0, 1, 2, 3]
    assert all(r["program"] > 0 and r["formula"] > 0 for r in rows)


@pytest.mark.slow
@needs_libtpu
def test_tpu_dcn_bytes_on_one_and_two_slices(tmp_path):
    out = tmp_path / "dcn.json"
    run_script(tmp_path, "tpu_dcn_bytes.py", "--model", "mt5_tiny", "--slice", "v5e-8",
               "--stages", "1", "--counts", "1,2", "--layouts", "zero", "--out", str(out))  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["slices"], r["layout"]) for r in rows] == [(1, "zero"), (2, "zero")]
    assert rows[1]["dcn_program"]["total"] > 0 and rows[0]["peak_bytes"] > 0


@pytest.mark.slow
@needs_libtpu
def test_tpu_seed_study_on_one_small_slice(tmp_path):
    out, plot = tmp_path / "tpu.json", tmp_path / "tpu.png"
    printed = run_script(tmp_path, "tpu_seed_study.py", "--generation", "v5e", "--slice",
                         "v5e-8", "--counts", "1", "--models", "mt5_tiny", "--out", str(out),
                         "--plot", str(plot))  # fmt: skip
    rows = json.loads(out.read_text())
    assert sorted(r["stage"] for r in rows) == [0, 1, 2, 3]
    assert all(r["step_s"] > 0 for r in rows if "step_s" in r)
    assert len(table_rows(printed, "mt5_tiny")) == 4 and plot.stat().st_size > 0
