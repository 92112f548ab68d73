"""bench/gpu_check.py, the check a GPU runs when one is lent (docs/gpu_check.md), run here as
its dry run: the whole work list, each item in its own process, on the CPU with mt5_tiny, the
kernels under Pallas's interpreter and the predictions from the same runs compiled for an H100
without one (under -m slow: run it before a GPU run). So the check cannot rot between GPUs."""

import importlib
import json
import math
import re
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

from t5scale.startup import cuda_plugin_installed

SCRIPT = REPO / "bench" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # the script's sibling modules, as a script has them
gpu_check = importlib.import_module("gpu_check")
gpu_gemms = importlib.import_module("gpu_check_gemms")
gpu_head = importlib.import_module("gpu_check_head")


def run_check(out, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *flags],
        capture_output=True, text=True, timeout=600, cwd=out.parent,
    )  # fmt: skip


def results(out) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


# Under -m slow, as a bench script that is not quick (issue 61): the default list, and its extras
# (the fp8 and einsum steps, the fp32 kernels: the same code under other options) with --all.
# CI: the runner's budget and its one-line errors (below), the step item's profile
# (test_device_profile.py), the kernels and the fused step (test_attention.py).
@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--all",)])
def test_the_dry_run_measures_every_item_of_the_list(tmp_path, flags):
    out = tmp_path / "check"
    done = run_check(out, *flags)
    assert done.returncode == 0, done.stdout[-3000:]
    lines = results(out)
    items = gpu_check.work_list(gpu_check.DRY_RUN, extras=bool(flags))
    # the attention kernels are extras since the head's kernel came first (twenty-seventh)
    dtypes = ("bfloat16", "float32") if flags else ()
    assert {line["item"]: line["status"] for line in lines if "status" in line} == {
        item.name: "done" for item in items
    }
    device = next(line for line in lines if "bf16_matmul_flops" in line)
    assert device["bf16_matmul_flops"] > 0
    # The chain through flax's FP8 dot: timed here, its FP8 GEMMs only on a card
    # (test_xla_gpu.py compiles the same dot into them for an H100)
    fp8 = next(line for line in lines if "fp8_matmul_flops" in line)
    assert fp8["fp8_matmul_flops"] > 0 and fp8["fp8_gemms"] == 0
    assert "through flax's FP8 dot" in (out / "gpu_check.md").read_text()
    # Three attentions in each dtype, the kernels (interpreted) within the tests' tolerance of
    # the einsum path in fp32 and never further from exact than it in bf16.
    kernels = [line for line in lines if "verdict" in line]
    assert sorted((k["attention"], k["dtype"]) for k in kernels) == sorted(
        (what, dtype) for what in ("encoder", "decoder", "cross") for dtype in dtypes
    )  # fmt: skip
    for kernel in kernels:
        assert (
            kernel["verdict"] == "ok"
            if kernel["dtype"] == "float32"
            else kernel["verdict"] != "WRONG"
        )
        assert kernel["ms_fused"] > 0 and kernel["ms_dot"] > 0
    # Each bf16 attention's passes timed at each candidate tile, the fastest kept for the steps.
    sweeps = {line["attention"]: line["tile_sweep"] for line in lines if "tile_sweep" in line}
    passes = {
        "encoder": ["forward", "dkv", "dq", "bias"],
        "decoder": ["forward", "dkv", "dq", "bias"],
        "cross": ["forward", "dkv", "dq"],
    }
    assert {what: [row["pass"] for row in rows] for what, rows in sweeps.items()} == (
        passes if flags else {}
    )
    for rows in sweeps.values():
        for row in rows:
            timed = [c for c in row["candidates"] if c["ms"] is not None]
            fastest = min(timed, key=lambda c: c["ms"])
            assert {k: fastest[k] for k in row["chosen"]} == row["chosen"]
    if flags:
        chosen = json.loads((out / "attention_tiles.json").read_text())
        assert set(chosen) == {"96x96", "23x23 causal", "23x96"}
    # The head item: XLA's route and the head's kernel (interpreted) at each candidate tile,
    # within bf16's rounding of each other, the fastest kept for the steps by d_model.
    (head,) = [line for line in lines if "head" in line and "xla_seconds" in line]
    timed_rows = [row for row in head["kernel"] if "seconds" in row]
    assert len(timed_rows) == len(gpu_head.DRY_CANDIDATES) and head["xla_seconds"] > 0
    assert all(max(row["errors_loss_dx_dw"]) < 2e-2 for row in timed_rows)
    assert all(row["kernel_chunk_s"] > 0 < row["gemm_chunk_s"] for row in timed_rows)
    fastest = min(timed_rows, key=lambda row: row["seconds"])
    assert list(head["chosen"].values()) == fastest["tiles"]
    assert json.loads((out / "head_tiles.json").read_text()) == {"64": head["chosen"]}
    step_items = {item.name for item in items if item.kind == "step"}
    steps = [line for line in lines if "step_s" in line and line["item"] in step_items]
    assert len(steps) == len(step_items)
    # t5scale's own training loop on a step item's run (with --all: the layer loop's), its steps'
    # times as metrics.jsonl records them
    loops = [line for line in lines if "step_s" in line and line["item"] not in step_items]
    assert [line["item"] for line in loops] == [
        item.name for item in items if item.kind == "training loop"
    ]
    assert len(loops) == bool(flags)
    for line in loops:
        assert len(line["steps_s"]) == gpu_check.DRY_RUN.timed_steps and line["tokens_per_s"] > 0
    assert (out / "gpu_check.md").read_text().count("(t5scale's training loop) |") == len(loops)
    # and each step's mean dispatched back to back, waited for once, as a training loop runs
    assert sum(line.get("back_to_back_s", 0) > 0 for line in lines) == len(steps)
    for step in steps:
        assert math.isfinite(step["loss"]) and step["tokens_per_s"] > 0
        assert len(step["steps_s"]) == gpu_check.DRY_RUN.timed_steps
        assert len(step["losses"]) == gpu_check.DRY_RUN.timed_steps + gpu_check.DRY_RUN.warmup_steps
    # FP8 against mixed precision, step for step on the same batches (issue 62's item; the dry
    # run's fp8 step is an extra: the mixed step's code under gin/precision/fp8.gin)
    fp8_table = "| mt5_tiny dots fused loop fp8 |" in (out / "gpu_check.md").read_text()
    assert fp8_table == bool(flags)
    predictions = [line for line in lines if "predicted_step_s" in line]
    if cuda_plugin_installed():  # the test extra installs it
        assert len(predictions) == len(steps)
        assert all(p["predicted_step_s"] > 0 and p["kernels"]["gemm"] > 0 for p in predictions)
        # The kernels' FLOPs as the inventory reads them from the H100 program: the encoder's
        # are eleven products of 2·B·N·T·S·H (two forward, four for dk and dv, three for dq,
        # two for the bias's gradient).
        # (the kernels item is an extra: with --all)
        if flags:
            encoder = next(k for k in kernels if k["attention"] == "encoder" and k["fused_flops"])
            shapes = gpu_check.DRY_RUN
            product = 2 * shapes.batch * shapes.heads * shapes.input_length**2 * 64
            assert encoder["fused_flops"] == 11 * product
            bf16 = [k for k in kernels if k["dtype"] == "bfloat16"]
            assert all(0 < k["fused_flops"] <= encoder["fused_flops"] for k in bf16)
            assert "FLOP-weighted" in (out / "gpu_check.md").read_text()
        with zipfile.ZipFile(out / "programs.zip") as programs:  # each program, to read again
            assert len(programs.namelist()) == len(steps)
            assert all("HloModule" in programs.read(name).decode()[:200]
                       for name in programs.namelist())  # fmt: skip
        # ... and read again: with the cluster file the run used, each step's prediction anew
        # from its saved program is the run's own (bench/gpu_check_repredict.py)
        again = subprocess.run(
            [sys.executable, str(REPO / "bench" / "gpu_check_repredict.py"), str(out),
             "--cluster", str(REPO / "gin" / "clusters" / "h100.gin")],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout  # fmt: skip
        table = again.splitlines()
        rows = [row.split(" | ") for row in table[table.index("|---" * 7 + "|") + 1 :] if row]
        assert len(rows) == len(steps) and all(row[3] == row[4] != "–" for row in rows)
    table = (out / "gpu_check.md").read_text()
    step_table = table.split("## Steps")[1].split("## GEMMs at the layers' shapes")[0]
    labels = ("| mt5_tiny |", "| mt5_tiny (fp8) |", "| mt5_tiny (bfloat16 logits) |",
              "| mt5_tiny (head kernel) |")  # fmt: skip
    assert sum(step_table.count(label) for label in labels) == len(steps)
    # The GEMMs item (an extra): each of the layers' shapes timed and priced, a row each
    gemms = [line for line in lines if "gemm_s" in line]
    shapes = {(g.m, g.k, g.n) for g in gpu_gemms.layer_gemms("mt5_tiny", gpu_check.DRY_RUN)}
    shapes = shapes if flags else set()
    assert {(g["gemm"]["m"], g["gemm"]["k"], g["gemm"]["n"]) for g in gemms} == shapes
    assert len(gemms) == len(shapes) and all(g["gemm_s"] > 0 < g["priced_s"] for g in gemms)
    gemm_rows = re.findall(r"^\| mt5_tiny \| (?:encoder|decoder) \|", table, re.MULTILINE)
    assert len(gemm_rows) == len(gemms)
    assert ("| encoder | float32 |" in table) == bool(flags)
    # Each step profiled (bench/gpu_check_profile.py), its table read from the profile.
    profiles = [line for line in lines if "profile" in line]
    assert len(profiles) == len(steps) and all(p["profile_events_with_hlo_op"] for p in profiles)
    assert table.count("### step mt5_tiny") == len(steps)
    # A run cut short keeps what it measured: the tables of its first lines.
    cut = tmp_path / "cut.jsonl"
    kept = lines[: lines.index(head) + 1]  # up to the head item's result
    cut.write_text("".join(json.dumps(line) + "\n" for line in kept))
    partial = gpu_check.tables(cut)
    assert "| mt5_tiny | 46 × 64 × 4,096 | kernel |" in partial and "| dots |" not in partial
    assert table.count("| mt5_tiny | 46 × 64 × 4,096 | kernel |") == len(gpu_head.DRY_CANDIDATES)


def test_items_past_the_budget_are_skipped_and_said_so(tmp_path):
    out = tmp_path / "check"
    done = run_check(out, "--budget-s", "0")
    assert done.returncode == 1
    statuses = {line["status"] for line in results(out) if "status" in line}
    assert statuses == {"skipped"}
    assert "skipped" in (out / "gpu_check.md").read_text()


def test_an_item_not_in_the_list_is_one_line(tmp_path):
    done = run_check(tmp_path / "check", "--only", "step mt5_huge")
    assert done.returncode == 1 and not (tmp_path / "check").exists()
    assert done.stderr.strip().splitlines() == [
        f"gpu_check: no item 'step mt5_huge'; the list: "
        f"{', '.join(i.name for i in gpu_check.work_list(gpu_check.DRY_RUN, extras=True))}"
    ]


def test_the_default_list_fits_its_budget_and_the_extras_run_when_asked():
    """On a card the default list (its items' walls as measured) fits the default budget, 9
    minutes; the einsum steps and the fp32 kernels run with --all or when named."""
    budget = gpu_check.build_parser().get_default("budget_s")
    default = gpu_check.work_list(gpu_check.GPU)
    every = gpu_check.work_list(gpu_check.GPU, extras=True)
    assert sum(item.estimate_s for item in default) <= budget <= 9 * 60
    extras = [item for item in every if item not in default]
    assert extras and all(item.extra for item in extras)
    assert {item.options.get("attention") for item in extras if item.kind == "step"} == {
        "dot", "fused"  # the einsum steps; mT5-XL at the batch that fills an H100 (measured)
    }  # fmt: skip
    assert "kernels float32" in {item.name for item in extras}
    assert [item for item in every if not item.extra] == default


def test_a_missing_tiles_file_is_one_line(tmp_path):
    done = run_check(tmp_path / "check", "--tiles", str(tmp_path / "nope.json"))
    assert done.returncode == 1 and not (tmp_path / "check").exists()
    assert done.stderr.strip().splitlines() == [
        f"gpu_check: --tiles {tmp_path / 'nope.json'}: no such file (an earlier run's "
        "attention_tiles.json)"
    ]


def test_a_run_without_programs_or_with_a_damaged_one_is_one_line_to_repredict(tmp_path):
    def repredict(out):
        script = REPO / "bench" / "gpu_check_repredict.py"
        return subprocess.run([sys.executable, str(script), str(out)], capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    (tmp_path / "results.jsonl").write_text('{"item": "device"}\n')
    missing = repredict(tmp_path)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert f"{tmp_path / 'programs.zip'} not found" in missing.stderr
    (tmp_path / "programs.zip").write_text("not a zip")
    damaged = repredict(tmp_path)
    assert damaged.returncode == 1
    assert damaged.stderr.strip().splitlines() == [
        f"gpu_check_repredict: {tmp_path / 'programs.zip'}: File is not a zip file"
    ]


def test_an_item_under_xla_flags_runs_with_them_and_the_others_without(tmp_path, monkeypatch):
    """The steps without command buffers are the unrolled steps with one XLA:GPU flag more (and
    dynamic-slice fusion, an extra, the loop step's): each flagged item's process gets its flag
    after the caller's XLA_FLAGS, and no other item's does."""
    every = gpu_check.work_list(gpu_check.GPU, extras=True)
    flagged = [item for item in every if item.xla_flags]
    assert [item.name for item in flagged] == [
        "step mt5_large dots fused unrolled without command buffers",
        "step mt5_small dots fused unrolled without command buffers",
        "step mt5_large dots fused loop dynamic-slice fusion",
        "step mt5_large dots fused unrolled dynamic-slice fusion",
    ]
    for item in flagged:
        unflagged = item.name.rsplit(" without", 1)[0].rsplit(" dynamic-slice", 1)[0]
        assert item.options == next(i.options for i in every if i.name == unflagged)
    assert not [item for item in gpu_check.work_list(gpu_check.DRY_RUN, True) if item.xla_flags]
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    show = [sys.executable, "-c", "import os; print('flags:', os.environ['XLA_FLAGS'])"]
    for flags in (flagged[0].xla_flags, ()):
        assert gpu_check._run_item(show, tmp_path, 60, flags) == ("done", None)
    log = (tmp_path / "log.txt").read_text().splitlines()
    printed = [line for line in log if line.startswith("flags:")]
    assert printed == [
        "flags: --xla_dump_to=/nowhere --xla_gpu_enable_command_buffer=",
        "flags: --xla_dump_to=/nowhere",
    ]
    assert log[0].startswith("$ XLA_FLAGS='--xla_dump_to=/nowhere --xla_gpu_enable_command_buf")


@pytest.mark.skipif(not cuda_plugin_installed(), reason="compiles for an H100: jax's CUDA plugin")
def test_the_gemms_item_times_one_gemm_a_product_on_an_h100():
    """The GEMMs item divides a program's time by its products: compiled for an H100, they are
    that many cuBLAS GEMMs and no other kernel (XLA merges dots that share an operand)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from t5scale.target import Target
    from t5scale.xla_gpu import GpuTopology

    gpu = Target.compile_only_gpus(GpuTopology("h100_sxm"))
    replicated = NamedSharding(Mesh(gpu.devices, ("d",)), PartitionSpec())
    lefts = [jax.ShapeDtypeStruct((7328, 512), jnp.bfloat16, sharding=replicated)] * 8
    rights = [jax.ShapeDtypeStruct((512, 384), jnp.bfloat16, sharding=replicated)] * 8
    lowered = jax.jit(gpu_gemms.independent_products).lower(lefts, rights)
    with gpu.compiling():
        text = lowered.compile(gpu.compiler_options).as_text()
    entry = text[text.index("ENTRY") :]
    assert len(re.findall(r'custom_call_target="__cublas\$lt\$matmul"', entry)) == 8
    assert " fusion(" not in entry and " copy(" not in entry
