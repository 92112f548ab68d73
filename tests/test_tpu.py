"""Compiling for TPU slices on this TPU-less machine (t5scale/xla_tpu.py): libtpu's deviceless
topologies, slices named as Cloud TPU names them, the mesh over slices, `plan` with a TPU pod
file, and a quiet CPU start with libtpu installed.

libtpu comes with the test extra (jax[tpu]); nothing here runs on a TPU."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import REPO, cli_inline, run_cli

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.analysis.kernels import Kernel, Program, ScheduledCollective
from t5scale.analysis.memory import model_state_bytes, zero3_collective_bytes
from t5scale.cli import IN_CHILD, main
from t5scale.config import build_run_config, parse_gin, study_runs
from t5scale.errors import ConfigError
from t5scale.model.mt5 import abstract_params
from t5scale.parallel.mesh import ParallelConfig, make_mesh
from t5scale.startup import libtpu_installed
from t5scale.study.config import StudyConfig
from t5scale.target import Target
from t5scale.train.config import RunConfig
from t5scale.whatif.compile import cached_analysis, compile_for, refusal_of
from t5scale.whatif.ici_dcn import (
    TorusAxis,
    dcn_op_seconds,
    op_seconds,
    seconds,
    slice_axes,
)
from t5scale.whatif.simulate import SimulateConfig, simulate
from t5scale.whatif.tpu_pod import TpuPodConfig
from t5scale.whatif.tpu_step import collective_seconds, predict_tpu_program
from t5scale.whatif.weak_scaling import weak_scale
from t5scale.xla_tpu import TpuSlice, TpuTopology

pytestmark = pytest.mark.skipif(not libtpu_installed(), reason="libtpu: the tpu extra (Linux)")

TINY = ["--gin_file=gin/models/mt5_tiny.gin", "--gin.INPUT_LENGTH=32", "--gin.TARGET_LENGTH=8",
        "--gin.DATA_SOURCE='synthetic'"]  # fmt: skip


@pytest.mark.parametrize(
    "name, generation, shape",
    [("v4-8", "v4", (2, 2, 1)), ("v5p-16", "v5p", (2, 2, 2)), ("v5p-128", "v5p", (4, 4, 4)),
     ("v5e-256", "v5e", (16, 16)), ("v5litepod-16", "v5e", (4, 4)), ("v6e-8", "v6e", (2, 4))],
)  # fmt: skip
def test_slices_are_named_as_cloud_tpu_names_accelerator_types(name, generation, shape):
    """v4 and v5p count TensorCores (two a chip), v5e and v6e chips."""
    one = TpuSlice.named(name)
    assert (one.generation, one.shape) == (generation, shape)
    cores = 2 if generation in ("v4", "v5p") else 1
    assert one.chips * cores == int(name.split("-")[1])


@pytest.mark.parametrize(
    "name, shape, said",
    [("v7x-8", None, "not an accelerator type"), ("v5p-12", None, "not a 3D slice"),
     ("v5e-8", "2x2", "not a 2D slice"), ("v5p-128", "4x4x8", "not a 3D slice"),
     ("v5p-128", "4xfourx4", "not a 3D slice")],
)  # fmt: skip
def test_a_slice_that_does_not_exist_is_one_line(name, shape, said):
    with pytest.raises(ConfigError, match=said):
        TpuSlice.named(name, shape)


def test_compile_only_chips_of_a_two_host_slice_and_of_two_slices():
    one = Target.compile_only_tpus(TpuTopology(TpuSlice.named("v5p-16")))
    assert one.size == 8 and one.is_tpu and one.compile_only and not one.runs_here
    assert len({d.process_index for d in one.devices}) == 2  # two TPU VMs of 4 chips
    assert one.dcn_groups == 1  # ICI joins the slice's hosts
    assert one.compiler_name == "xla:tpu TPU v5, v5p-16 (2x2x2)"
    two = Target.compile_only_tpus(TpuTopology(TpuSlice.named("v5e-8"), slices=2))
    assert two.size == 16 and two.dcn_groups == 2
    assert two.compiler_name == "xla:tpu TPU v5 lite, v5e-8 (2x4), 2 slices"
    assert Target.of(two.devices).compile_only  # the devices alone say so too


def _slice_of(device) -> int:
    return getattr(device, "slice_index", None) or 0


def test_the_mesh_puts_replicas_across_slices_and_zero_inside_them():
    devices = list(TpuTopology(TpuSlice.named("v5p-16"), slices=2).devices())
    mesh = make_mesh(ParallelConfig(zero_stage=1), devices)
    assert dict(mesh.shape) == {
        "replica": 2,
        "pipeline": 1,
        "zero": 8,
        "tensor": 1,
    }  # a replica per slice
    for replica in range(2):  # each replica's zero group is one slice (ICI), over its 2 hosts
        assert len({_slice_of(d) for d in mesh.devices[replica].flat}) == 1
        assert len({d.process_index for d in mesh.devices[replica].flat}) == 2
    # zero_across_hosts: ZeRO spans both slices (over DCN), one replica
    across = make_mesh(ParallelConfig(zero_stage=3, zero_across_hosts=True), devices)
    assert dict(across.shape) == {"replica": 1, "pipeline": 1, "zero": 16, "tensor": 1}
    assert len({_slice_of(d) for d in across.devices.flat}) == 2


def test_tensor_takes_part_of_a_torus_dimension():
    """tensor=2 on a 4x4x4 slice: mesh_utils refuses it unless an axis may split a physical
    dimension; the two chips of a tensor group are ICI neighbours."""
    devices = list(TpuTopology(TpuSlice.named("v5p-128")).devices())
    mesh = make_mesh(ParallelConfig(zero_stage=3, tensor=2), devices)
    assert dict(mesh.shape) == {"replica": 1, "pipeline": 1, "zero": 32, "tensor": 2}
    for pair in mesh.devices.reshape(-1, 2):
        a, b = (d.coords for d in pair)
        assert sum(abs(x - y) for x, y in zip(a, b, strict=True)) == 1


def _quiet_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}


def test_with_libtpu_and_no_tpu_jax_starts_on_the_cpu_quietly():
    """libtpu, left alone, prints that it finds no TPU VM (on starting jax, and again on
    describing a topology); t5scale starts jax on the CPU and drops those lines."""
    code = (
        "import t5scale, jax; print(jax.devices()[0].platform); "
        "from t5scale.xla_tpu import TpuSlice, TpuTopology; "
        "print(len(TpuTopology(TpuSlice.named('v5e-8')).devices()))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_quiet_env(), cwd=REPO, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cpu", "8"]
    assert done.stderr == ""


def test_without_libtpu_a_tpu_plan_is_one_line_naming_the_install():
    code = (
        "import sys; sys.modules['libtpu'] = None; from t5scale.cli import main; "
        f"sys.exit(main({['plan', *TINY, '--gin_file=gin/clusters/tpu_v5e.gin']!r}))"
    )
    env = _quiet_env() | {IN_CHILD: "1"}  # plan's compile in this process, without libtpu
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "t5scale: error: compiling for TPUs needs libtpu: pip install 't5scale[tpu]' "
        "(jax[tpu]: libtpu, XLA's TPU compiler; Linux only)"
    ]


# tpu_v5e.gin's figures, for a pod built in the test
V5E = dict(name="tpu_v5e", generation="v5e", chips_per_host=8, device_memory_gb=16,
           memory_bandwidth=819e9, peak_flops=197e12, ici_link_bandwidth=4.5e10,
           ici_links_per_chip=4, dcn_bandwidth_per_host=25e9)  # fmt: skip


@pytest.mark.slow  # CI: plan and simulate on the pod (below), the study's own trials on the CPU
def test_the_study_compiles_for_the_pods_chips_and_times_on_the_cpu(tmp_path, capsys, monkeypatch):
    """The study's compile-only round on XLA:TPU, for a slice of the pod's generation holding
    the point's devices (1: v5e-1), its HBM as the budget; the timed round on CPUs."""
    study_dir = tmp_path / "study"
    done = run_cli(
        "study", "--gin_file=gin/clusters/tpu_v5e.gin", "--gin.StudyConfig.models=['mt5_tiny']",
        "--gin.StudyConfig.stages=[3]", "--gin.StudyConfig.devices=[1]",
        "--gin.StudyConfig.input_length=32", "--gin.StudyConfig.target_length=8",
        "--gin.StudyConfig.max_timed_steps=4", "--gin.StudyConfig.max_timing_s=10",
        "--gin.StudyConfig.repeats=1", f"--gin.StudyConfig.study_dir={study_dir}",
        env=_quiet_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compile-only rounds: XLA's TPU compiler for tpu_v5e's chips (v5e, 1 slice), " \
        "16 GB each" in done.stdout  # fmt: skip
    lines = [json.loads(line) for line in (study_dir / "results.jsonl").read_text().splitlines()]
    (compiled,) = [r for r in lines if r.get("kind") == "compile"]
    timed = [r for r in lines if r.get("kind") == "timed"]
    assert compiled["analysis"]["compiler"] == "xla:tpu TPU v5 lite, v5e-1 (1x1)"
    assert compiled["memory_budget_bytes"] == 16e9
    assert timed and all(r["analysis"]["compiler"] == "xla:cpu" for r in timed)
    # A device count that is no slice of the generation (v5e-3), and a pod of two slices
    # over 4 devices (2 × v5e-2, which Cloud TPU does not have), are one line before any trial.
    for devices, slices in ((3, 1), (4, 2)):
        code, _, err = cli_inline([
            "study", "--gin_file=gin/clusters/tpu_v5e.gin", f"--gin.TpuPodConfig.slices={slices}",
            "--gin.StudyConfig.models=['mt5_tiny']", f"--gin.StudyConfig.devices=[{devices}]",
            f"--gin.StudyConfig.study_dir={tmp_path / 'refused'}",
        ], capsys, monkeypatch)  # fmt: skip
        assert code == 2 and len(err.strip().splitlines()) == 1 and "v5e-" in err, err
    assert TpuPodConfig(**V5E).topology(8) == TpuTopology(TpuSlice.named("v5e-8"))
    assert TpuPodConfig(**V5E, slices=2).topology(16).size == 16


@functools.cache
def _tpu_plan(stages: tuple[int, ...]) -> tuple[dict, RunConfig, dict]:
    """`plan --json` of mt5_tiny (fp32, 2 sequences per chip, one micro-batch) for a v5e-8
    slice, 8 chips on 2 TPU VMs, at `stages`; and the run's unboxed parameter shapes."""
    args = ["plan", "--json", *TINY, "--gin_file=gin/clusters/tpu_v5e.gin",
            "--gin.TpuPodConfig.slice='v5e-8'", "--gin.PlanConfig.micro_batch_size=2",
            f"--gin.PlanConfig.stages={list(stages)}"]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:  # compiled here, as plan's child would
        patch.setenv(IN_CHILD, "1")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    assert code == 0, err.getvalue()
    parse_gin(["gin/models/mt5_tiny.gin"], [flag.removeprefix("--gin.") for flag in TINY[1:]])
    run = build_run_config()
    plan = json.loads(out.getvalue())
    assert [s["stage"] for s in plan["stages"]] == list(stages)
    plan["stages"] = {s["stage"]: s for s in plan["stages"]}
    return plan, run, nn.meta.unbox(abstract_params(run.model))


# CI: stages 0 and 3 (an XLA:TPU compile of some 8 s each); 1 and 2 with -m slow (stage 2 across
# two slices in CI: test_zero_across_slices.py).
@pytest.fixture
def tpu_plan():
    return _tpu_plan((0, 3))


@pytest.fixture
def tpu_plan_1_2():
    return _tpu_plan((1, 2))


def test_plan_compiles_the_stages_for_the_slice_with_xla_tpu(tpu_plan):
    plan, _, _ = tpu_plan
    assert plan["compiler"] == "xla:tpu TPU v5 lite, v5e-8 (2x4)"
    assert plan["devices"] == 8 and plan["device_memory_gb"] == 16
    for stage in plan["stages"].values():
        assert stage["mesh"] == {"replica": 1, "pipeline": 1, "zero": 8, "tensor": 1}
        assert stage["fits"] and stage["xla_memory_per_device"]["peak_estimate_bytes"] > 0
    state = [s["xla_model_state_per_device"]["xla_parameters_and_optimizer_bytes"]
             for s in plan["stages"].values()]  # fmt: skip
    assert state[0] > state[1]  # stage 3 shards all of it


@pytest.mark.slow
def test_the_state_per_chip_falls_stage_by_stage(tpu_plan, tpu_plan_1_2):
    state = {number: s["xla_model_state_per_device"]["xla_parameters_and_optimizer_bytes"]
             for plan, _, _ in (tpu_plan, tpu_plan_1_2)
             for number, s in plan["stages"].items()}  # fmt: skip
    assert [state[n] for n in range(4)] == sorted(state.values(), reverse=True)


# ---- what XLA:TPU's program does on the wire, read against the ZeRO formula --------------------


def _within(found: float, expected: float, tolerance: float = 0.05) -> bool:
    return abs(found - expected) <= tolerance * expected


def _collectives(plan: dict, stage: int) -> dict:
    return plan["stages"][stage]["collectives"]


def test_stage_0_all_reduces_the_gradients_on_a_tpu_slice(tpu_plan):
    plan, _, params = tpu_plan
    found, state = _collectives(plan, 0), model_state_bytes(params, {})
    assert _within(found["all-reduce"]["bytes"], state.gradients), found
    assert "reduce-scatter" not in found and "all-gather" not in found


@pytest.mark.slow
def test_stage_1_all_reduces_the_gradients_and_gathers_the_updated_shards(tpu_plan_1_2):
    plan, _, params = tpu_plan_1_2
    found, state = _collectives(plan, 1), model_state_bytes(params, {})
    assert _within(found["all-reduce"]["bytes"], state.gradients), found
    assert "reduce-scatter" not in found
    # the updated shards gathered back, each once (an async gather counted at its start only)
    assert _within(found["all-gather"]["bytes"], state.parameters)


@pytest.mark.slow
def test_stage_2_reduce_scatters_the_gradients_whatever_form_xla_tpu_gives_them(tpu_plan_1_2):
    """XLA:TPU writes most of ZeRO 2's reduce-scatters as an all-reduce whose result each chip
    slices its 1/8 of: read as the reduce-scatters they are, their bytes are the gradients'."""
    plan, _, params = tpu_plan_1_2
    found, state = _collectives(plan, 2), model_state_bytes(params, {})
    assert _within(found["reduce-scatter"]["operand_bytes"], state.gradients)
    assert _within(found["reduce-scatter"]["bytes"], state.gradients / 8)
    assert found["reduce_scatters_as_all_reduce_and_slice"] > 0
    assert found.get("all-reduce", {"bytes": 0})["bytes"] < 0.01 * state.gradients
    assert _within(found["all-gather"]["bytes"], state.parameters)


def test_stage_3_reduce_scatters_and_gathers_as_the_formula_says(tpu_plan):
    """Its loops carry no trip count for XLA:TPU (t5scale counts them from the loop); the
    reduce-scatters and the layers' all-gathers match the formula (they were 1.5x it while one
    micro-batch ran in a scan of length 1: train/gradients.py, accumulate_gradients)."""
    plan, run, params = tpu_plan
    found = _collectives(plan, 3)
    batch = plan["stages"][3]["batch_size"]
    gathered, scattered = zero3_collective_bytes(params, run.model, run.data, batch, 1)
    assert "unknown_trip_count_loops" not in found
    assert _within(found["reduce-scatter"]["operand_bytes"], scattered)
    assert _within(found["all-gather"]["bytes"], gathered)


def test_a_program_larger_than_the_chip_compiles_for_the_planner_to_say_so():
    """XLA:TPU refuses a program whose buffers exceed the chip's HBM; for chips that are not
    here the target tells it not to (xla_tpu.COMPILER_OPTIONS), and the memory analysis says
    by how much: a v5e chip (16 GB) asked for two 14.4 GB results."""
    target = Target.compile_only_tpus(TpuTopology(TpuSlice.named("v5e-1")))
    assert target.compiler_name == "xla:tpu TPU v5 lite, v5e-1 (1x1)"
    chip = jax.sharding.SingleDeviceSharding(target.devices[0])
    outer = jax.jit(lambda x: (x[:, None] * x[None, :], x[:, None] + x[None, :]),
                    in_shardings=chip, out_shardings=chip)  # fmt: skip
    lowered = outer.lower(jax.ShapeDtypeStruct((60_000,), jnp.float32))
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        lowered.compile()
    compiled = lowered.compile(compiler_options=target.compiler_options)
    results = compiled.memory_analysis().output_size_in_bytes  # TPU tiles pad a little
    assert 2 * 60_000**2 * 4 <= results <= 1.01 * 2 * 60_000**2 * 4 and results > 16e9


def _notebook_grid_on(runtime: str) -> None:
    """The Colab notebook's settings (its parameter cell, bf16 as it sets off the CPU) at each
    of its stages on every device of a Colab TPU runtime: one v5e chip, or the 8 TensorCores
    of a v2-8; compiled for them here, and within their memory."""
    cells = json.loads((REPO / "notebooks/t5scale_colab.ipynb").read_text())["cells"]
    settings: dict = {}
    exec("".join(next(c["source"] for c in cells if "# Parameters" in "".join(c["source"]))),
         settings)  # fmt: skip
    target = Target.compile_only_tpus(TpuTopology(TpuSlice.named(runtime)))
    assert target.size in settings["DEVICES"]
    study = StudyConfig(
        models=tuple(settings["MODELS"]), stages=tuple(settings["STAGES"]),
        devices=(target.size,), input_length=settings["INPUT_LENGTH"],
        target_length=settings["TARGET_LENGTH"], dtype="bfloat16",
    )  # fmt: skip
    base = study_runs(study)
    memory = {"v5e-1": 16e9, "v2-8": 8e9}[runtime]  # HBM a device: a v5e chip, a v2 core
    for configuration in study.configurations():
        point = study.point(configuration, target.size)
        analysis = compile_for(point.run(base[point.model]), target).analysis
        assert analysis.compiler == target.compiler_name
        assert analysis.memory_per_device.peak_estimate_bytes < memory


# Slow (18-24 s each, beyond the suite's budget); the TPU compile path itself is held by the
# tests above.
@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["v5e-1", "v2-8"])
def test_the_notebooks_whole_grid_compiles_for_a_colab_tpu_runtime(runtime):
    _notebook_grid_on(runtime)


@pytest.mark.slow  # CI: every stage across two slices (test_zero_across_slices.py)
def test_zero_3_over_two_64_chip_slices_is_read_as_gathers_and_dcn_transfers(tpu_plan):
    """ZeRO 3 over two v5p-128 slices. Inside each 64-chip slice XLA:TPU writes a parameter
    all-gather as an all-reduce of zeros into which each chip put its part; between slices it
    sends to its megascale runtime (host transfers that name the collective). t5scale reads
    those as the all-gathers they are, and as collectives over DCN; no gradient-sized
    all-reduce is left."""
    _, run, params = tpu_plan
    target = Target.compile_only_tpus(TpuTopology(TpuSlice.named("v5p-128"), slices=2))
    staged = weak_scale(run, 3, target.size, 2, dcn_groups=target.dcn_groups)
    analysis = compile_for(staged, target).analysis
    found = analysis.collectives
    assert analysis.mesh == {
        "replica": 1,
        "pipeline": 1,
        "zero": 128,
        "tensor": 1,
    }  # ZeRO over both slices
    assert found.all_gathers_as_all_reduce_of_padded_parts > 0
    padded = [op for op in analysis.collective_ops if op.form == "all-reduce of a zero-padded part"]
    assert {op.kind for op in padded} == {"all-gather"}
    dcn = [op for op in analysis.collective_ops if op.form == "dcn"]
    assert {"all-gather", "reduce-scatter"} <= {op.kind for op in dcn}
    assert all(op.group is None for op in dcn)  # every slice takes part
    gathered, _ = zero3_collective_bytes(params, run.model, run.data, staged.train.batch_size, 1)
    assert found.by_kind["all-gather"].bytes >= 0.95 * gathered
    # what stays an all-reduce is small: loss sums, norms, the ordering chain (≤ 32 KiB each)
    reduced = [op.bytes for op in analysis.collective_ops if op.kind == "all-reduce"]
    assert max(reduced) < 0.02 * model_state_bytes(params, {}).gradients


def test_a_collective_is_timed_over_the_torus_axes_its_group_spans():
    """op_seconds places a replica group on the chips' coordinates: along a whole axis of a
    4x4x4 cube it is a ring, along half of it a line; XLA:TPU's reduce-scatter written as an
    all-reduce and slice costs an all-reduce; a group across slices (DCN) is left out."""
    cube = TpuSlice.named("v5p-128")
    devices = TpuTopology(cube).devices()
    at = {tuple(device.coords): index for index, device in enumerate(devices)}
    along_x = tuple(at[(x, 0, 0)] for x in range(4))
    link = 9e10

    def op(kind, group, form=None, count=3):
        return CollectiveOp(kind, count, 4e6, 1e6, group, "body", form=form)

    ring = [TorusAxis(4, True), TorusAxis(1, True), TorusAxis(1, True)]
    assert op_seconds(op("all-gather", along_x), devices, cube, link) == 3 * seconds(
        "all-gather", 4e6, ring, link
    )
    half = (at[(0, 0, 0)], at[(1, 0, 0)])
    assert op_seconds(op("all-gather", half), devices, cube, link) == 3 * seconds(
        "all-gather", 4e6, [TorusAxis(2, False)], link
    )
    scattered = op("reduce-scatter", along_x, form="all-reduce+slice")
    assert op_seconds(scattered, devices, cube, link) == 3 * seconds("all-reduce", 4e6, ring, link)
    every = op_seconds(op("all-reduce", None), devices, cube, link)
    assert every == 3 * seconds("all-reduce", 4e6, slice_axes((4, 4, 4), (True,) * 3), link)
    two = TpuTopology(TpuSlice.named("v5p-16"), slices=2).devices()
    assert op_seconds(op("all-reduce", None), two, TpuSlice.named("v5p-16"), link) is None
    assert op_seconds(op("all-reduce", None, form="dcn"), devices, cube, link) is None


def test_the_plan_times_each_stages_collectives_over_the_slices_ici(tpu_plan):
    plan, _, _ = tpu_plan
    ici = {number: stage["ici_seconds_per_step"] for number, stage in plan["stages"].items()}
    assert all(seconds > 0 for seconds in ici.values())
    assert all(stage["dcn_seconds_per_step"] == 0 for stage in plan["stages"].values())  # 1 slice
    assert ici[3] > ici[0]  # stage 3 gathers every layer's parameters as well


def test_transfers_between_slices_take_each_chips_share_of_its_hosts_dcn():
    """XLA:TPU's collectives between slices (form 'dcn'; the payload each chip hands its
    megascale runtime): over S slices an all-gather brings S − 1 parts, a reduce-scatter
    sends (S − 1)/S of the payload, an all-reduce both; ICI collectives are not DCN's."""
    per_chip = 25e9 / 4  # tpu_v5p.gin: a 4-chip host's 25 GB/s

    def dcn(kind):
        return CollectiveOp(kind, 2, 1e6, 1e6, None, "body", form="dcn")

    assert dcn_op_seconds(dcn("all-gather"), 4, per_chip) == pytest.approx(2 * 3e6 / per_chip)
    assert dcn_op_seconds(dcn("reduce-scatter"), 4, per_chip) == pytest.approx(
        2 * 0.75e6 / per_chip
    )
    assert dcn_op_seconds(dcn("all-reduce"), 2, per_chip) == pytest.approx(2 * 1e6 / per_chip)
    assert (
        dcn_op_seconds(CollectiveOp("all-reduce", 2, 1e6, 1e6, None, "body"), 2, per_chip) is None
    )


# ---- simulate on a TPU pod: the program's operations, its collectives, its schedule --------------


def test_the_tpu_programs_matmuls_are_the_models_flops(tpu_plan):
    """XLA:TPU writes its matmuls as convolutions (the contraction often a window over a
    padded dimension); read with their loops' trip counts they add up to the model's FLOPs.
    Until one micro-batch ran without a scan, XLA:TPU's copies of the layer loops made 1.5x."""
    plan, _, _ = tpu_plan
    for stage in plan["stages"].values():
        matmuls = stage["kernels"]["gemm"]["flops"]
        assert _within(matmuls, stage["flops_per_step"]["model_per_device"], 0.02), stage["stage"]


def test_a_tpu_programs_time_is_its_operations_roofline_and_its_exposed_collectives():
    """predict_tpu_program: each operation at the slower of its FLOPs at the chip's peak and
    its bytes at HBM's; an async collective hidden behind the operations scheduled up to its
    done, up to their time; a synchronous one exposed."""
    pod = TpuPodConfig(**V5E, slice="v5e-8")
    topology = pod.topology()
    devices = topology.devices()
    gemm = Kernel("gemm", runs=10, flops=197e12 * 1e-3, bytes_read=1000, dtype="bf16")  # 1 ms
    copy = Kernel("copy", runs=4, bytes_read=819e9 * 1e-3 // 2, bytes_written=819e9 * 1e-3 // 2)
    gather = CollectiveOp("all-gather", 3, 8e6, 1e6, None, "body")
    run = op_seconds(dataclasses.replace(gather, count=1), devices, topology.slice, 4.5e10)
    program = Program(8, (gemm, copy), (
        ScheduledCollective(gather, synchronous=False, overlapped=((1, 1),)),
        ScheduledCollective(dataclasses.replace(gather, kind="all-reduce"), synchronous=True),
    ))  # fmt: skip
    timed = predict_tpu_program(program, pod, topology, devices)
    assert timed.compute_s == pytest.approx(14e-3)
    assert timed.compute_by_class_s["gemm"] == pytest.approx(10e-3)
    reduce_run = op_seconds(
        CollectiveOp("all-reduce", 1, 8e6, 1e6, None, "body"), devices, topology.slice, 4.5e10
    )
    assert timed.communication_s == pytest.approx(3 * run + 3 * reduce_run)
    hidden = min(run, 1e-3)  # behind one copy's millisecond
    assert timed.hidden_s == pytest.approx(3 * hidden)
    assert timed.step_s == pytest.approx(14e-3 + 3 * (run - hidden) + 3 * reduce_run)
    # between slices: each chip's share of its host's DCN (8 chips on a v5e host)
    two = TpuTopology(topology.slice, 2)
    transfer = CollectiveOp("all-reduce", 1, 8e6, 8e6, None, "body", form="dcn")
    assert collective_seconds(transfer, two.devices(), two, pod) == pytest.approx(
        dcn_op_seconds(transfer, 2, 25e9 / 8)
    )


# a bf16 run of mt5_tiny on a v5e-8 pod, as simulate is given it
TPU_SIMULATE = [*TINY, "--gin_file=gin/precision/mixed.gin", "--gin.ModelConfig.dtype='bfloat16'",
                "--gin_file=gin/clusters/tpu_v5e.gin", "--gin.TpuPodConfig.slice='v5e-8'",
                "--gin.SimulateConfig.micro_batch_size=2"]  # fmt: skip


@pytest.mark.slow  # CI: simulate of one slice (below); every stage across two (test_zero_across_slices)
def test_simulate_times_a_tpu_pod_from_its_program_and_says_it_is_unvalidated(capsys, monkeypatch):
    """`t5scale simulate` with a TPU pod file: stage 3 compiled by XLA:TPU for 2 slices (one
    slice: the test below), its program's operations and collectives timed over ICI and DCN,
    overlap from the schedule."""
    code, out, err = cli_inline(
        ["simulate", "--json", *TPU_SIMULATE, "--gin.SimulateConfig.nodes=(2,)",
         "--gin.SimulateConfig.stages=(3,)"], capsys, monkeypatch,
    )  # fmt: skip
    assert code == 0, err
    assert "unvalidated" in err
    result = json.loads(out)
    assert result["path"] == "tpu" and result["compiler"].startswith("xla:tpu TPU v5 lite")
    (row,) = result["rows"]
    assert row["devices"] == 16, row
    assert row["compute_s"] > 0 and 0 < row["exposed_communication_s"] <= row["communication_s"]
    assert row["step_s"] == pytest.approx(row["compute_s"] + row["exposed_communication_s"])
    parse_gin(["gin/models/mt5_tiny.gin"], [flag.removeprefix("--gin.") for flag in TINY[1:]])
    with pytest.raises(ConfigError, match="bf16"):  # fp32 compute: the chips' peak is bf16's
        simulate(build_run_config(), TpuPodConfig(**V5E, slice="v5e-8"), SimulateConfig())


# CI: the refused stage alone (its row, and simulate ends as it should); the stage it goes on to,
# a second compile of the 16.8M-row table, under -m slow.
@pytest.mark.parametrize("stages", [(0,), pytest.param((0, 3), marks=pytest.mark.slow)])
def test_simulate_reports_a_program_xla_tpu_refuses_for_memory_and_goes_on(
    capsys, monkeypatch, stages
):
    """A table of 16.8M rows of 384 is a 25.8 GB fp32 master whole on each chip at stage 0:
    XLA:TPU refuses any buffer over a v5e chip's 17.2 GB, even when told not to crash on a
    program that does not fit. simulate says so in the compiler's figures and goes on to
    stage 3, whose shards compile (and do not fit either: XLA's estimate says so)."""
    code, out, err = cli_inline(
        ["simulate", *TPU_SIMULATE, "--gin.ModelConfig.vocab_size=16777216",
         "--gin.ModelConfig.d_model=384", "--gin.SimulateConfig.nodes=(1,)",
         f"--gin.SimulateConfig.stages={stages}", "--gin.SimulateConfig.micro_batch_size=1"],
        capsys, monkeypatch,
    )  # fmt: skip
    assert code == 0, err
    said = out + err  # the progress lines, then the table
    assert "Traceback" not in said
    assert "stage 0, every step, 1 × v5e-8: does not fit (XLA refused it: a 25.8 GB buffer, the device " \
        "has 17.2 GB)" in said  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| ")][1:]  # after the header
    assert [row.split(" | ")[0] for row in rows] == [f"| {stage}" for stage in sorted(stages)[::-1]]
    assert rows[-1].endswith("no: XLA refused it: a 25.8 GB buffer, the device has 17.2 GB |")
    if 3 in stages:
        peak = re.search(r"\| no \((\d+)\) \|$", rows[0])  # XLA's peak, GB: over the chip's 16
        assert peak and int(peak.group(1)) > 17, rows[0]
        assert "stage 3, every step, 1 × v5e-8: 0." in said


def test_any_other_compiler_failure_is_one_line():
    """What XLA:TPU says of a program it cannot make for another reason (here a kernel it has
    no emitter for) becomes one line that names the point: the CLI's exit 2."""
    target = Target.compile_only_tpus(TpuTopology(TpuSlice.named("v5e-1")))
    chip = jax.sharding.SingleDeviceSharding(target.devices[0])

    def unknown_kernel(x):
        return jax.ffi.ffi_call("t5scale_no_such_kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    lowered = jax.jit(unknown_kernel, in_shardings=chip, out_shardings=chip).lower(
        jax.ShapeDtypeStruct((8,), jnp.float32)
    )
    with pytest.raises(jax.errors.JaxRuntimeError) as refused:
        lowered.compile(compiler_options=target.compiler_options)
    with pytest.raises(ConfigError) as said:
        refusal_of(refused.value, "stage 2, 2 × v5e-8")
    line = str(said.value)
    assert "\n" not in line and line.startswith("stage 2, 2 × v5e-8: the compiler failed")
    assert "t5scale_no_such_kernel not found" in line


@pytest.mark.slow  # reads the program the test above compiled, from its cache
def test_the_schedule_finds_every_collective_the_count_finds_on_two_slices():
    """The TPU program's schedule (kernels.read_program) and its collective count
    (hlo.collective_ops) read the same collectives, bytes for bytes: XLA:TPU's async start
    fusions, its synchronous collectives and its transfers between slices. (The program
    simulate compiled above, from its cache.)"""
    files = [flag.removeprefix("--gin_file=") for flag in TPU_SIMULATE if "gin_file" in flag]
    parse_gin(files, [flag.removeprefix("--gin.") for flag in TPU_SIMULATE if "--gin." in flag])
    run = build_run_config()
    target = Target.compile_only_tpus(TpuTopology(TpuSlice.named("v5e-8"), slices=2))
    staged = weak_scale(run, 3, target.size, 2, dcn_groups=target.dcn_groups)
    analysis = cached_analysis(staged, target, int(16e9))
    counted = sum(op.count * max(op.bytes, op.operand_bytes) for op in analysis.collective_ops)
    scheduled = analysis.program.collectives
    found = sum(c.op.count * max(c.op.bytes, c.op.operand_bytes) for c in scheduled)
    assert found == pytest.approx(counted, rel=1e-6)
    assert any(not c.synchronous and c.overlapped for c in scheduled)
    assert any(c.op.form == "dcn" and not c.synchronous for c in scheduled)


@pytest.mark.slow  # CI: a pipeline's program (test_pipeline.py); simulate of one slice (above)
def test_simulate_times_a_pipeline_over_ici_and_across_slices(capsys, monkeypatch):
    """A pipeline of 2 stages compiled by XLA:TPU inside one v5e-8 slice and across 2 slices:
    its collective permutes timed over the torus, and between slices over DCN."""
    code, out, err = cli_inline(
        ["simulate", "--json", *TPU_SIMULATE, "--gin.SimulateConfig.nodes=(1, 2)",
         "--gin.SimulateConfig.stages=(1,)", "--gin.SimulateConfig.pipelines=(2,)",
         "--gin.SimulateConfig.micro_batches=2"], capsys, monkeypatch,
    )  # fmt: skip
    assert code == 0, err
    one, two = json.loads(out)["rows"]
    assert (one["pipeline"], one["micro_batches"], two["devices"]) == (2, 2, 16)
    for row in (one, two):
        assert row["communication_by_kind_s"]["collective-permute"] > 0, row
