"""Compiling for H100s on this GPU-less machine (t5scale/xla_gpu.py): XLA:GPU's own programs of
mt5_tiny-sized steps on one GPU and on 2 nodes × 8, every ZeRO stage, fp32 and mixed; what
plan and simulate make of them; bad input on the new settings.

jax's CUDA plugin comes with the test extra. The programs are compiled once per module (each
takes 10–20 s: XLA's GPU pipeline and LLVM for ~200 kernels) and nothing is ever run."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import REPO, cli_inline, run_cli

from t5scale.config import build_hardware, build_run_config, parse_gin
from t5scale.train.setup import build_setup
from t5scale.whatif.nccl import network_payload_bytes
from t5scale.whatif.plan import step_dcn_formula
from t5scale.whatif.weak_scaling import weak_scale
from t5scale.xla_gpu import (
    COMPILER_OPTIONS,
    MACHINE_CODE_UNUSED,
    PTXAS_STAND_IN,
    GpuTopology,
    compiler_name,
    is_compile_only_gpu,
)

H100 = "NVIDIA H100 80GB HBM3"
SHORT = ["INPUT_LENGTH=64", "TARGET_LENGTH=16"]
# What each stage's gradients and parameters do on the wire (docs/concepts.md's table): the
# kinds that move more than the loss and the norms (a few KiB; mt5_tiny's gradients: 1.4 MiB).
SCALARS = 16 * 1024
STAGE_COLLECTIVES = {
    0: {"all-reduce"},
    1: {"all-reduce", "all-gather"},
    2: {"reduce-scatter", "all-gather"},
    3: {"reduce-scatter", "all-gather"},
}


def without_source_locations(program: str) -> list[str]:
    """The program's lines less where in Python each op came from (the call sites differ): the
    metadata of each instruction and the module's tables of files, functions and frames."""
    return [
        re.sub(r", metadata=\{[^}]*\}", "", line)
        for line in program.splitlines()
        if not re.match(r"^(\s*\d+ |FileNames|FunctionNames|FileLocations|StackFrames)", line)
    ]


def compile_for(topology: GpuTopology, stage: int, precision: str):
    """mt5_tiny at `stage` on `topology`'s GPUs, batch 2 per GPU, compiled (not run)."""
    parse_gin(["gin/models/mt5_tiny.gin", f"gin/precision/{precision}.gin"], SHORT, [])
    run = weak_scale(build_run_config(), stage, topology.size, 2, dcn_groups=topology.nodes)
    return build_setup(run, topology.devices()).compile()


# Under -m slow: the suite's budget. In CI, ZeRO between nodes is read from TPU slices' programs
# through the same hardware interface (test_zero_across_slices.py), and GPU programs for two
# nodes are compiled by plan and simulate below.
@pytest.fixture(
    scope="module", params=[pytest.param(p, marks=pytest.mark.slow) for p in ("fp32", "mixed")]
)
def two_nodes(request):
    """Stages 0–3 on 2 nodes × 8 H100s, and how many arrays were alive around the compiles."""
    alive = len(jax.live_arrays())
    topology = GpuTopology("h100_sxm", nodes=2, gpus_per_node=8)
    steps = {stage: compile_for(topology, stage, request.param) for stage in range(4)}
    return request.param, steps, alive, len(jax.live_arrays())


def test_each_stage_compiles_for_two_h100_nodes_with_its_shards_and_collectives(two_nodes):
    precision, steps, _, _ = two_nodes
    arguments = {}
    for stage, step in steps.items():
        analysis = step.analysis
        assert analysis.compiler == f"xla:gpu {H100}, 2 nodes x 8"
        assert analysis.backend == "gpu"
        assert analysis.precision.mode == {"fp32": "float32", "mixed": "mixed"}[precision]
        memory = analysis.memory_per_device
        assert memory.argument_bytes > 0 and memory.temp_bytes > 0
        # The stage's shards in XLA:GPU's own argument bytes: its model state is the formula's.
        state = analysis.model_state_per_device
        formula = state.zero_formula_bytes
        from_xla = state.xla_parameters_and_optimizer_bytes + state.gradient_bytes
        assert abs(from_xla - formula.total) <= 0.02 * formula.total, (stage, from_xla, formula)
        arguments[stage] = memory.argument_bytes
        # The stage's collectives, each one an async pair on the GPU.
        big = {
            kind for kind, total in analysis.collectives.by_kind.items() if total.bytes > SCALARS
        }
        assert big == STAGE_COLLECTIVES[stage], (stage, analysis.collectives.by_kind)
        # The GPU program's kernels: cuBLAS GEMMs, fusions, copies and the collectives' pairs.
        kernels = analysis.kernels
        assert kernels.gemm.count > 0 and kernels.gemm.flops > 0 and kernels.fusion.count > 0
        assert (
            kernels.collective.count
            >= sum(t.count for t in analysis.collectives.by_kind.values())
            > 0
        )
        text = step.compiled.as_text()
        for kind in big:
            assert f"{kind}-start" in text or f"{kind}-done" in text, (stage, kind)
    # Optimizer state (stage 1), then parameters too (stage 3) leave each GPU's arguments.
    assert arguments[0] > 2 * arguments[1]
    assert arguments[1] > 2 * arguments[3]


def test_stages_1_and_2_move_what_the_formula_says_between_two_nodes(two_nodes):
    """ZeRO over both nodes' 16 H100s: what each GPU's collectives hand the network (laid out
    hierarchically, inside the node first) is the DCN formula's (analysis/memory.py), within
    5%, kind by kind."""
    _, steps, _, _ = two_nodes
    for stage in (1, 2):
        program = network_payload_bytes(steps[stage].analysis.collective_ops, 16, 8)
        formula = step_dcn_formula(steps[stage].setup, slices=2)
        assert formula.all_reduce if stage == 1 else formula.reduce_scatter
        for kind, expected in dataclasses.asdict(formula).items():
            found = getattr(program, kind)
            assert found == pytest.approx(expected, rel=0.05, abs=SCALARS), (stage, kind)


@pytest.mark.slow
def test_memory_per_gpu_on_two_nodes_is_no_higher_than_on_one(two_nodes):
    """Stages 1 and 2 with the same sequences per GPU (weak scaling): ZeRO over 16 GPUs keeps
    less a GPU than over 8, and no buffer grows with the nodes."""
    precision, steps, _, _ = two_nodes
    for stage in (1, 2):
        one_node = compile_for(GpuTopology("h100_sxm", nodes=1, gpus_per_node=8), stage,
                               precision).analysis.memory_per_device  # fmt: skip
        two = steps[stage].analysis.memory_per_device
        assert two.peak_estimate_bytes <= one_node.peak_estimate_bytes, (stage, one_node, two)


def test_every_scatter_add_sums_in_float32(two_nodes):
    """A 16-bit scatter-add has no native atomic on GPUs and serialises on repeated indices:
    the relative-position bias's gradient in bf16 took a one-H200 mt5_large step from under a
    second to 6.6 s (docs/benchmarks.md, the GPU check of 2026-11-27). Every scatter in the
    program (the look-up tables' gradients) sums in float32, at every stage and precision."""
    _, steps, _, _ = two_nodes
    for stage, step in steps.items():
        scatters = re.findall(r"= (\w+)\[[^\]]*\]\S* scatter\(", step.compiled.as_text())
        assert scatters and set(scatters) == {"f32"}, (stage, scatters)


def test_nothing_is_allocated_or_run_for_compile_only_gpus(two_nodes):
    _, steps, alive_before, alive_after = two_nodes
    assert alive_after == alive_before
    devices = steps[0].setup.mesh.devices.flat
    assert is_compile_only_gpu(devices) and jax.default_backend() == "cpu"
    options = steps[0].setup.target.compiler_options
    assert options.items() >= (COMPILER_OPTIONS | MACHINE_CODE_UNUSED).items()
    assert Path(options["xla_gpu_kernel_cache_file"]).stat().st_size > 0
    # ptxas is t5scale's stand-in, which makes no machine code
    ptxas = Path(options["xla_gpu_cuda_data_dir"], "bin", "ptxas")
    assert ptxas.read_text() == PTXAS_STAND_IN
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True)
    assert re.search(r"V\d+\.\d+\.\d+", version.stdout)


def test_reused_kernels_and_the_ptxas_stand_in_leave_the_program_as_it_was(two_nodes):
    """Stage 3 was compiled after stages 0-2 filled this process's kernel cache, with the ptxas
    stand-in and LLVM at -O0: compiled again without the cache, pointed at the real ptxas (XLA
    may reuse machine code it assembled earlier in this process) and at LLVM's default level,
    its HLO, schedule, memory and cost are the same. At real sizes, bench/seed_study_predicted.py's 96 predictions with the
    stand-in equal, digit for digit, those made with the real ptxas (docs/benchmarks.md).
    (One precision: neither knows one; each recompile takes ~15 s.)"""
    precision, steps, _, _ = two_nodes
    if precision != "mixed":
        pytest.skip("shown on the mixed-precision programs")
    setup = steps[3].setup
    lowered = setup.train_step().lower(setup.state, setup.abstract_batch())
    fresh = lowered.compile(compiler_options=COMPILER_OPTIONS)
    assert without_source_locations(fresh.as_text()) == without_source_locations(
        steps[3].compiled.as_text()
    )
    assert str(fresh.memory_analysis()) == str(steps[3].compiled.memory_analysis())
    assert fresh.cost_analysis() == steps[3].compiled.cost_analysis()


# CI: one H100's mixed-precision program (test_attention.py, the H100 step's kernels)
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_one_h100_program(precision):
    step = compile_for(GpuTopology("h100_sxm"), 0, precision)
    analysis = step.analysis
    assert analysis.compiler == f"xla:gpu {H100}, 1 node x 1"
    assert analysis.memory_per_device.temp_bytes > 0
    assert not analysis.collective_ops  # one GPU: nothing to exchange
    assert "__cublas$" in step.compiled.as_text()  # GEMMs by cuBLAS, not Triton (no autotuner)


@pytest.mark.slow  # CI: simulate compiles for a cluster file's GPUs (below); plan, for a TPU pod's
def test_plan_with_a_cluster_file_compiles_for_its_gpus(capsys, monkeypatch):
    code, out, err = cli_inline([
        "plan", "--gin_file=gin/models/mt5_tiny.gin", "--gin_file=gin/precision/mixed.gin",
        "--gin_file=gin/clusters/h100.gin", "--gin.DEVICES=16", "--gin.PlanConfig.stages=[3]",
        *(f"--gin.{binding}" for binding in SHORT), "--gin.PlanConfig.micro_batch_size=2", "--json",
    ], capsys, monkeypatch)  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    assert plan["compiler"] == f"xla:gpu {H100}, 2 nodes x 8"
    assert plan["device_memory_gb"] == 80
    (three,) = plan["stages"]
    assert three["stage"] == 3 and three["xla_memory_per_device"]["temp_bytes"] > 0
    assert three["mesh"] == {"replica": 1, "pipeline": 1, "zero": 16, "tensor": 1}


@pytest.mark.slow  # two processes, two compiles: the cache policy (xla_gpu.py) changes rarely
def test_a_compile_only_program_is_not_written_to_the_persistent_cache(tmp_path):
    """JAX cannot read a compile-only GPU program back from its persistent cache (it warns and
    compiles again): the target's cache policy keeps the step out, while the CPU programs the
    command also compiles are written as usual."""
    cache = tmp_path / "cache"
    env = os.environ | {"JAX_COMPILATION_CACHE_DIR": str(cache),
                        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
    common = ["plan", "--gin_file=gin/models/mt5_tiny.gin", "--gin.PlanConfig.stages=[0]",
              *(f"--gin.{binding}" for binding in SHORT), "--json"]  # fmt: skip
    done = run_cli(*common, "--gin_file=gin/clusters/h100.gin", "--gin.DEVICES=8", env=env)
    assert done.returncode == 0, done.stderr
    written = {path.name.split("-")[0] for path in cache.iterdir()}
    assert written and "jit_step" not in written, written
    done = run_cli(*common, "--gin.DEVICES=2", env=env)  # the same step for CPU devices
    assert done.returncode == 0, done.stderr
    assert "jit_step" in {path.name.split("-")[0] for path in cache.iterdir()}


def test_cluster_topologies_are_whole_nodes():
    parse_gin(["gin/clusters/a100.gin"], [], [])
    cluster = build_hardware()
    assert (
        compiler_name(cluster.topology(4).devices()) == "xla:gpu NVIDIA A100-SXM4-80GB, 1 node x 4"
    )
    assert cluster.topology(24).nodes == 3
    from t5scale.errors import ConfigError

    with pytest.raises(ConfigError, match="12 GPUs are not whole nodes of 8"):
        cluster.topology(12)


def test_a_malformed_gpu_target_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    target = tmp_path / "h100.txtpb"
    target.write_text("gpu_device_info {\n  core_count: 132\n  cores: 1\n}\n")
    code, _, err = cli_inline([
        "plan", "--gin_file=gin/models/mt5_tiny.gin", "--gin_file=gin/clusters/h100.gin",
        f"--gin.ClusterConfig.gpu_target='{target}'", "--gin.DEVICES=8",
    ], capsys, monkeypatch)  # fmt: skip
    assert code == 2
    assert err.strip().splitlines() == [
        f"t5scale: error: GPU compile target '{target}' is not a GpuTargetConfig XLA can read: "
        "Error parsing text-format stream_executor.GpuTargetConfigProto: 3:8: Message type "
        '"stream_executor.GpuDeviceInfoProto" has no field named "cores".'
    ]


def test_without_the_plugin_a_gpu_compile_names_the_install_command(tmp_path):
    """A Python whose packages are this one's but for jax's CUDA plugin, as on a machine that
    lacks it (site-packages linked entry by entry, the plugin's left out)."""
    site = Path(jax.__file__).parents[1]
    packages = tmp_path / "site-packages"
    packages.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(("jax_plugins", "jax_cuda12_")):
            (packages / entry.name).symlink_to(entry)
    # -S: no site-packages but these; the command in this process (its child would have them)
    env = os.environ | {"PYTHONPATH": f"{REPO}{os.pathsep}{packages}", "T5SCALE_COMMAND_CHILD": "1"}
    done = subprocess.run(
        [sys.executable, "-S", "-m", "t5scale.cli", "plan", "--gin_file=gin/models/mt5_tiny.gin",
         "--gin_file=gin/clusters/h100.gin"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "t5scale: error: compiling for GPUs needs jax's CUDA plugin: "
        "pip install 't5scale[gpu-compile]' (jax's CUDA 12 plugin, Linux only)"
    ]


def test_with_the_plugin_and_no_gpu_jax_starts_on_the_cpu_quietly():
    """No JAX_PLATFORMS given: the plugin would print a traceback and absl lines."""
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    code = "import t5scale, jax; print(jax.devices()[0].platform)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "cpu"
    assert done.stderr == ""


def test_simulate_times_the_gpu_program_and_says_so():
    from t5scale.whatif.simulate import SimulateConfig, simulate
    from t5scale.whatif.step_time import predict_from_program

    parse_gin(["gin/models/mt5_tiny.gin", "gin/clusters/h100.gin"], SHORT, [])
    run, cluster = build_run_config(), build_hardware()
    config = SimulateConfig(nodes=(2,), stages=(3,), micro_batch_size=2, compiler="gpu")
    result = simulate(run, cluster, config, show=lambda _: None)
    assert result.path == "gpu" and result.to_json()["path"] == "gpu"
    (row,) = result.rows
    assert row.analysis.compiler == f"xla:gpu {H100}, 2 nodes x 8"
    predicted = row.prediction
    # Stage 3's traffic as XLA:GPU combined it; part of it hidden behind the kernels that XLA
    # scheduled inside its async windows, never more than there is.
    assert {"all-gather", "reduce-scatter"} <= set(predicted.communication_by_kind_s)
    assert 0 <= predicted.hidden_s <= predicted.communication_s
    assert predicted.step_s == pytest.approx(
        predicted.compute_s + predicted.exposed_communication_s
    )
    bound = predict_from_program(row.analysis, run.model, cluster, overlap=False)
    assert bound.step_s == pytest.approx(predicted.compute_s + predicted.communication_s)
    # The CPU path stays, and says which one it is.
    on_one_node = dataclasses.replace(config, compiler="cpu", nodes=(1,))  # 8 emulated devices
    cpu = simulate(run, cluster, on_one_node, show=lambda _: None)
    assert cpu.path == "cpu" and cpu.rows[0].analysis.compiler == "xla:cpu"


@pytest.mark.slow  # CI: plan and simulate compile for the cluster's GPUs; the study's trials
def test_the_study_compiles_for_the_cluster_gpus_and_times_on_the_cpu(tmp_path):
    study_dir = tmp_path / "study"
    done = run_cli(
        "study", "--gin_file=gin/clusters/h100.gin", "--gin.StudyConfig.models=['mt5_tiny']",
        "--gin.StudyConfig.stages=[3]", "--gin.StudyConfig.devices=[2]",
        "--gin.StudyConfig.input_length=32", "--gin.StudyConfig.target_length=8",
        "--gin.StudyConfig.max_timed_steps=4", "--gin.StudyConfig.max_timing_s=10",
        "--gin.StudyConfig.repeats=1", f"--gin.StudyConfig.study_dir={study_dir}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compile-only rounds: XLA's GPU compiler for dgx_h100's GPUs (h100_sxm), 80 GB" in (
        done.stdout
    )
    lines = [json.loads(line) for line in (study_dir / "results.jsonl").read_text().splitlines()]
    compiled = [r for r in lines if r.get("kind") == "compile"]
    timed = [r for r in lines if r.get("kind") == "timed"]
    assert len(compiled) == 1 and timed
    for record in compiled:
        assert record["analysis"]["compiler"] == f"xla:gpu {H100}, 1 node x 2"
        assert record["memory_budget_bytes"] == 80e9
    for record in timed:
        assert record["analysis"]["compiler"] == "xla:cpu"


@pytest.mark.slow  # CI: simulate compiles for a cluster file's GPUs (below); plan, a TPU pod's
def test_plan_compile_checks_a_job_as_its_gin_files_give_it(capsys, monkeypatch):
    job = [
        "plan", "--gin_file=gin/models/mt5_tiny.gin", "--gin_file=gin/zero/stage2.gin",
        "--gin_file=gin/clusters/h100.gin", "--gin.DEVICES=16", "--gin.PlanConfig.job=True",
        *(f"--gin.{binding}" for binding in SHORT), "--json",
    ]  # fmt: skip
    code, out, err = cli_inline([*job, "--gin.TrainConfig.batch_size=32"], capsys, monkeypatch)
    assert code == 0, err
    (only,) = json.loads(out)["stages"]
    # The job's own stage, batch and mesh: a replica per node, ZeRO inside it.
    assert only["stage"] == 2 and only["batch_size"] == 32
    assert only["mesh"] == {"replica": 2, "pipeline": 1, "zero": 8, "tensor": 1}
    assert only["fits"] and only["kernels"]["gemm"]["count"] > 0
    code, _, err = cli_inline([*job, "--gin.TrainConfig.batch_size=24"], capsys, monkeypatch)
    assert code == 2
    assert err.strip().splitlines() == [  # the progress line (stderr under --json), then
        f"compiling for xla:gpu {H100}, 2 nodes x 8",
        "t5scale: error: global batch 24 is not divisible by data-parallel size 16 × "
        "micro_batches 1 = 16",
    ]


_H100_STEPS: dict = {}


def _one_h100_step(*bindings: str):
    """mt5_tiny, mixed precision, batch 2, fused attention, compiled for one H100, once a
    process for each set of bindings (the tests below share the loop's remat 'full' and 'dots')."""
    from t5scale.model import mt5

    key = (bindings, mt5.KEPT_UNROLLED)  # a test may change what unrolled 'dots' keeps
    if key not in _H100_STEPS:
        parse_gin(["gin/models/mt5_tiny.gin", "gin/precision/mixed.gin"],
                  [*SHORT, "ModelConfig.attention='fused'", *bindings], [])  # fmt: skip
        run = weak_scale(build_run_config(), 0, 1, 2)
        _H100_STEPS[key] = build_setup(run, GpuTopology("h100_sxm").devices()).compile()
    return _H100_STEPS[key]


def _backward_forward_kernels(step) -> int:
    """Attention forward kernels the backward pass runs again (op_name under transpose)."""
    names = re.findall(r'op_name="([^"]*t5_attention_forward[^"]*)"', step.compiled.as_text())
    return sum("transpose(" in name for name in names)


@pytest.mark.slow  # CI: the unrolled layers' numbers (test_model), remat on the card's program
def test_unrolled_layers_need_fewer_non_gemm_kernels_and_keep_the_remat():
    """ModelConfig.scan_layers=False on one H100 (mt5_tiny, mixed, remat full): fewer fusions
    and copies than the layer loop, and the GEMM FLOPs of the remat's recomputed forward kept."""
    kernels = {}
    for scan in (True, False):
        unrolled = () if scan else ("ModelConfig.scan_layers=False",)
        step = _one_h100_step("ModelConfig.remat='full'", *unrolled)
        assert step.analysis.to_json()["scan_layers"] is scan  # step_analysis.json's
        kernels[scan] = step.analysis.kernels
    loop, unrolled = kernels[True], kernels[False]
    assert unrolled.gemm.flops == loop.gemm.flops
    assert unrolled.fusion.count + unrolled.copy.count < loop.fusion.count + loop.copy.count


@pytest.mark.slow  # CI: the remat ladder's memory on the CPU (test_remat.py)
def test_remat_dots_keeps_the_attention_s_output_and_runs_no_forward_kernel_again():
    """Remat 'dots' keeps the fused attention's output and log-sum-exp as it keeps matmuls'
    outputs: the backward pass runs only the backward kernels; 'full' runs the forward again."""
    dots, full = (
        _one_h100_step("ModelConfig.remat='dots'"),
        _one_h100_step("ModelConfig.remat='full'"),
    )
    assert _backward_forward_kernels(dots) == 0
    assert _backward_forward_kernels(full) > 0
    assert dots.analysis.kernels.attention.count < full.analysis.kernels.attention.count


@pytest.mark.slow  # CI: each layer einsum through flax's FP8 einsum is three FP8 GEMMs on an
# H100 (below), the inventory names and prices them (below), and the fp8 step trains (test_fp8.py)
def test_every_layer_gemm_of_the_fp8_step_is_an_fp8_gemm():
    """gin/precision/fp8.gin's step for one H100: each layer's matmuls (6 an encoder layer, 10 a
    decoder layer), forward and both gradients, are FP8 cuBLASLt GEMMs, named so by the kernel
    inventory; the output layer's three (forward and its gradients, in the tiled head) are the
    only bf16 ones. Their FLOPs are the mixed step's; the mixed step has fewer GEMMs (79
    against 99 here), as XLA merges bf16 GEMMs that share an operand and no FP8 ones."""
    fp8 = _one_h100_step("PrecisionConfig.mode='fp8'", "ModelConfig.remat='dots'")
    mixed = _one_h100_step("ModelConfig.remat='dots'")
    model = fp8.setup.run.model
    assert fp8.analysis.to_json()["precision"]["mode"] == "fp8"
    kernels, reference = fp8.analysis.kernels, mixed.analysis.kernels
    layer_matmuls = 6 * model.num_encoder_layers + 10 * model.num_decoder_layers
    assert kernels.fp8_gemm.count == 3 * layer_matmuls
    assert kernels.gemm.count - kernels.fp8_gemm.count == 3
    assert reference.fp8_gemm.count == 0
    assert kernels.gemm.flops == reference.gemm.flops
    assert kernels.gemm.count > reference.gemm.count
    text = fp8.compiled.as_text()
    assert text.count('custom_call_target="__cublas$lt$matmul$f8"') == 3 * layer_matmuls


@pytest.mark.slow  # four H100 programs; CI: the remat ladder's memory (test_remat.py)
def test_unrolled_dots_keeps_the_norms_and_the_gated_gelu(monkeypatch):
    """Unrolled, remat 'dots' also keeps the norms' outputs and the gated GELU's product
    (mt5.KEPT_UNROLLED): the non-GEMM kernels read and write less than when it makes them again;
    in the loop, where keeping would copy them into stacks, nothing changes."""
    from t5scale.model import mt5

    def non_gemm_bytes(scan: bool) -> int:
        unrolled = () if scan else ("ModelConfig.scan_layers=False",)
        kernels = _one_h100_step("ModelConfig.remat='dots'", *unrolled).analysis.kernels
        return sum(k.bytes_read + k.bytes_written for k in (kernels.fusion, kernels.copy))

    kept = {scan: non_gemm_bytes(scan) for scan in (True, False)}
    monkeypatch.setattr(mt5, "KEPT_UNROLLED", ())
    made_again = {scan: non_gemm_bytes(scan) for scan in (True, False)}
    assert kept[False] < made_again[False]
    assert kept[True] == made_again[True]


@pytest.mark.slow  # CI: a pipeline's program and its idle ticks (test_pipeline.py), simulate's
# GPU path (above)
def test_simulate_times_a_pipeline_across_nodes_from_its_program():
    from t5scale.whatif.nccl import placement
    from t5scale.whatif.simulate import SimulateConfig, format_simulation, simulate

    parse_gin(["gin/models/mt5_tiny.gin", "gin/clusters/h100.gin"], SHORT, [])
    run, cluster = build_run_config(), build_hardware()
    config = SimulateConfig(nodes=(2,), stages=(1, 3), micro_batch_size=2, compiler="gpu",
                            pipelines=(2,), micro_batches=4)  # fmt: skip
    result = simulate(run, cluster, config, show=lambda _: None)
    (row,) = result.rows  # stage 3 is not pipelined
    assert (row.stage, row.pipeline, row.analysis.micro_batches) == (1, 2, 4)
    assert row.analysis.mesh == {"replica": 1, "pipeline": 2, "zero": 8, "tensor": 1}
    # The stages span the nodes: each permute of the schedule crosses the network.
    permutes = [c.op for c in row.analysis.program.collectives if c.op.kind == "collective-permute"]
    assert permutes and all(placement(op.group, 16, 8).nodes == 2 for op in permutes)
    assert row.prediction.communication_by_kind_s["collective-permute"] > 0
    assert "| pipeline (micro-batches) |" in format_simulation(result)


def _gradient_program(layer, target: str, *input_shapes: tuple[int, ...]) -> str:
    """The program, compiled for one `target` GPU as t5scale compiles (its options and cache
    policy), of the gradient of a sum of squares of the flax `layer`'s bf16 output, with respect
    to its variables and its bf16 inputs."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from t5scale.target import Target

    gpu = Target.compile_only_gpus(GpuTopology(target))
    replicated = NamedSharding(Mesh(gpu.devices, ("d",)), PartitionSpec())
    inputs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=replicated)
              for shape in input_shapes]  # fmt: skip
    variables = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
        jax.eval_shape(layer.init, jax.random.key(0), *inputs),
    )

    def loss(variables, *inputs):
        return jnp.sum(layer.apply(variables, *inputs).astype(jnp.float32) ** 2)

    arguments = tuple(range(1 + len(inputs)))
    lowered = jax.jit(jax.grad(loss, argnums=arguments)).lower(variables, *inputs)
    with gpu.compiling():
        return lowered.compile(gpu.compiler_options).as_text()


def _fp8_dense_program(target: str) -> str:
    """A bf16 Dense layer with flax's FP8 dot (delayed scaling), forward and backward."""
    import flax.linen as nn
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    layer = nn.Dense(256, dtype=jnp.bfloat16, use_bias=False,
                     dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)  # fmt: skip
    return _gradient_program(layer, target, (512, 128))


def _fp8_dense_gemms(target: str) -> list[list[str]]:
    """The FP8 Dense layer's cuBLASLt GEMMs on `target`: each call's target and its two matrix
    operands' types."""
    text = _fp8_dense_program(target)
    shapes = dict(re.findall(r"^\s*(%\S+) = (\w+)\[", text, re.M))
    calls = re.findall(r"custom-call\(([^)]*)\), custom_call_target=\"(__cublas\$lt[^\"]*)\"", text)
    return [[call, *(shapes.get(name) for name in operands.split(", ")[:2])]
            for operands, call in calls]  # fmt: skip


def test_the_gpu_targets_know_their_cuda_version_so_fp8_gemms_compile(tmp_path):
    """XLA rewrites flax's quantize-dequantize-dot pattern into FP8 cuBLASLt GEMMs only for a
    CUDA runtime that has them: the H100's target file names CUDA 12.9, and the layer's three
    GEMMs are FP8 (e4m3 × e4m3 forward; e5m2 gradients backward). Without the version (a copy
    of the file without it) XLA takes CUDA 0 and runs them in bf16."""
    gemms = _fp8_dense_gemms("h100_sxm")
    assert [g[0] for g in gemms] == ["__cublas$lt$matmul$f8"] * 3, gemms
    assert ["f8e4m3fn", "f8e4m3fn"] in [g[1:] for g in gemms]
    assert sum("f8e5m2" in g[1:] for g in gemms) == 2  # the data and weight gradients
    from t5scale.xla_gpu import target_text

    unversioned = tmp_path / "h100_no_runtime.txtpb"
    unversioned.write_text(
        "\n".join(
            line
            for line in target_text("h100_sxm").splitlines()
            if not line.startswith("runtime_version")
        )  # fmt: skip
    )
    assert {g[0] for g in _fp8_dense_gemms(str(unversioned))} == {"__cublas$lt$matmul"}


def test_the_kernel_inventory_names_the_fp8_gemms_and_prices_them_at_the_fp8_peak():
    """The FP8 layer's program read as the cluster model reads a step: its three GEMMs counted
    among the GEMMs and as FP8 ones, their FLOPs the layer's (2 · 512 · 128 · 256 each), and the
    H100 cluster prices them at its FP8 peak."""
    from t5scale.analysis.hlo_module import parse_module
    from t5scale.analysis.kernels import read_program
    from t5scale.whatif.gpu_step import kernel_seconds

    program = read_program(parse_module(_fp8_dense_program("h100_sxm")))
    inventory = program.inventory
    assert inventory.fp8_gemm.count == inventory.gemm.count == 3
    assert inventory.fp8_gemm.flops == inventory.gemm.flops == 3 * 2 * 512 * 128 * 256
    assert "of which fp8    3×" in inventory.summary()
    parse_gin(["gin/clusters/h100.gin"], [], [])
    cluster = build_hardware()
    gemm = next(k for k in program.kernels if k.kind == "gemm")
    as_bf16 = dataclasses.replace(gemm, dtype="bf16", flops=gemm.flops * 1e6)  # compute-bound
    as_fp8 = dataclasses.replace(as_bf16, dtype=gemm.dtype)
    assert kernel_seconds(as_fp8, cluster, launch_s=0) == pytest.approx(
        kernel_seconds(as_bf16, cluster, launch_s=0) * 989.4 / 1978.9
    )


# The forms of t5scale/model/mt5.py's layer matmuls (q, k, v; o; the gated FFN's stacked input
# projection; its output projection), at small sizes: the einsums issue 62 puts in FP8.
LAYER_EINSUMS = [
    ("bqd,dhk->bqhk", (2, 64, 128), (128, 4, 32)),
    ("bqhk,hkd->bqd", (2, 64, 4, 32), (4, 32, 128)),
    ("bld,dtf->bltf", (2, 64, 128), (128, 2, 256)),
    ("blf,fd->bld", (2, 64, 256), (256, 128)),
]


@pytest.mark.parametrize(
    "equation, x_shape, w_shape", LAYER_EINSUMS, ids=[e[0] for e in LAYER_EINSUMS]
)
def test_each_layer_einsum_through_flax_s_fp8_einsum_is_three_fp8_gemms(equation, x_shape, w_shape):
    """Forward and backward through `fp8_ops.Fp8Einsum`, compiled for one H100: the product,
    the input's gradient and the weight's, each an FP8 cuBLASLt GEMM (multi-axis contractions
    and batch-free stacks included), and no bf16 GEMM left."""
    import flax.linen as nn
    from flax.linen import fp8_ops

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, w):
            return fp8_ops.Fp8Einsum()(equation, x, w)

    text = _gradient_program(Layer(), "h100_sxm", x_shape, w_shape)
    assert (
        re.findall(r'custom_call_target="(__cublas[^"]*)"', text) == ["__cublas$lt$matmul$f8"] * 3
    )
