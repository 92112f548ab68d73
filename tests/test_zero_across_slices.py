"""ZeRO across TPU slices read against its formula (t5scale/analysis/memory.py,
dcn_formula_bytes): what each stage hands DCN per chip per step, in XLA:TPU's compiled program,
and memory per chip that does not grow with the slices (docs/cluster_model.md, "ZeRO across
slices"). Compiled here for v5e-8 slices (8 chips on 2 TPU VMs each) without a TPU.

The model is mt5_tiny's shape with a wider model dimension, heads and vocabulary, in mixed
precision: with mt5_tiny's 64-wide rows a chip's share of a small leaf is a few dozen values,
which a TPU tile pads, and the formula does not count tiles. Heads are 128 wide because stage
3's per-layer collectives keep the leaves' shapes (t5scale/train/gradients.py,
gather_over_zero), and mT5's 64-wide heads cross DCN padded to 128 lanes there: a measured
residual (docs/cluster_model.md), not what this file checks."""

from __future__ import annotations

import dataclasses

import pytest

from t5scale.analysis.collective_ops import format_bytes
from t5scale.analysis.memory import dcn_program_bytes, outer_dcn_formula_bytes
from t5scale.config import build_hardware, build_run_config, parse_gin
from t5scale.parallel.zero import get_stage
from t5scale.startup import libtpu_installed
from t5scale.target import Target
from t5scale.whatif.plan import Plan, PlanConfig, StagePlan, compile_stage_plan, format_plan
from t5scale.whatif.weak_scaling import weak_scale

pytestmark = pytest.mark.skipif(not libtpu_installed(), reason="libtpu: the tpu extra (Linux)")

MODEL = [
    "ModelConfig.vocab_size=32768", "ModelConfig.d_model=256", "ModelConfig.d_ff=512",
    "ModelConfig.d_kv=128", "ModelConfig.dtype='bfloat16'", "INPUT_LENGTH=32",
    "TARGET_LENGTH=8", "DATA_SOURCE='synthetic'", "TpuPodConfig.slice='v5e-8'",
]  # fmt: skip
SEQUENCES_PER_CHIP = 2


def _staged(stage: int, slices: int, layout: str = "zero", micro_batches: int = 1):
    """(run, target, pod) of the stage on `slices` v5e-8 slices: ZeRO over every chip of every
    slice ('zero'), or a replica per slice with ZeRO inside it ('replica'; 'diloco': the
    replicas step on their own, an outer step every 4)."""
    parse_gin(
        ["gin/models/mt5_tiny.gin", "gin/precision/mixed.gin", "gin/clusters/tpu_v5e.gin"],
        [*MODEL, f"TpuPodConfig.slices={slices}"],
    )
    run, pod = build_run_config(), build_hardware()
    if layout == "diloco":
        run = dataclasses.replace(run, sync=dataclasses.replace(run.sync, mode="diloco", every=4))
    target = Target.compile_only_tpus(pod.topology())
    replicas = 1 if layout == "zero" else slices
    staged = weak_scale(
        run, stage, target.size, SEQUENCES_PER_CHIP, micro_batches=micro_batches,
        replicas=replicas, dcn_groups=target.dcn_groups,
    )  # fmt: skip
    return staged, target, pod


def _plan(*point) -> StagePlan:
    """The point compiled (nothing allocated), as `plan` compiles a stage."""
    staged, target, pod = _staged(*point)
    return compile_stage_plan(staged, target, pod.device_memory_gb * 1e9, pod)


class _Plans(dict):
    """Each point compiled once for the file's tests, when a test first asks for it: the fast
    tests need two of them (stage 2 on 1 and 2 slices, about 15 s each on the 2-core
    machine), the slow ones nine more."""

    def __missing__(self, point: tuple) -> StagePlan:
        self[point] = _plan(*point)
        return self[point]


@pytest.fixture(scope="module")
def plans() -> dict[tuple, StagePlan]:
    return _Plans()


def _kinds(dcn) -> dict[str, float]:
    return {k: v for k, v in dataclasses.asdict(dcn).items() if v}


@pytest.mark.parametrize(
    "stage", [*(pytest.param(s, marks=pytest.mark.slow) for s in (0, 1, 3)), 2]
)
def test_every_stage_hands_dcn_what_the_formula_says_across_two_slices(plans, stage):
    """Per chip per step, collective by collective, within 5%: the gradient shard each chip
    holds after its slice's reduction crosses once, and stages 1-3 gather each chip's own
    part of the parameters (stage 3: every layer twice, and the vocabulary-split tables'
    activations)."""
    plan = plans[(stage, 2, "zero", 1)]
    program, formula = _kinds(plan.dcn_program), _kinds(plan.dcn_formula)
    for kind, expected in formula.items():
        assert program.get(kind) == pytest.approx(expected, rel=0.05), (stage, program, formula)
    # Beside them only the step's loss sums and token count, a few scalars, are all-reduced.
    others = sum(found for kind, found in program.items() if kind not in formula)
    assert others < 0.01 * plan.dcn_formula.total, (stage, program, formula)


@pytest.mark.slow
def test_stage_2_hands_dcn_each_micro_batch_s_gradient_shard(plans):
    """Stage 2 keeps a 1/N accumulator: each micro-batch's gradients are reduce-scattered, over
    ICI and then between slices, so DCN carries M shards a step."""
    one, two = plans[(2, 2, "zero", 1)], plans[(2, 2, "zero", 2)]
    assert two.dcn_program.reduce_scatter == pytest.approx(2 * one.dcn_program.reduce_scatter,
                                                           rel=0.05)  # fmt: skip
    assert two.dcn_program.reduce_scatter == pytest.approx(two.dcn_formula.reduce_scatter,
                                                           rel=0.05)  # fmt: skip


@pytest.mark.slow
def test_a_replica_per_slice_hands_dcn_only_its_gradient_shard(plans):
    """With a replica per slice ZeRO's collectives stay on the slice's ICI: only the reduced
    gradient shard is all-reduced between slices, once a step."""
    plan = plans[(2, 2, "replica", 1)]
    assert plan.analysis.mesh["replica"] == 2 and plan.analysis.mesh["zero"] == 8
    assert _kinds(plan.dcn_formula).keys() == {"all_reduce"}
    assert _kinds(plan.dcn_program).keys() == {"all_reduce"}
    assert plan.dcn_program.all_reduce == pytest.approx(plan.dcn_formula.all_reduce, rel=0.05)


@pytest.mark.parametrize(
    "stage",
    [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3)],  # CI: the DCN's bytes
)
def test_memory_per_chip_does_not_grow_with_the_slices(plans, stage):
    """Weak scaling (the same sequences per chip) from 1 to 2 slices with ZeRO over both: the
    state shards over twice the chips, and no buffer grows with the slice count."""
    one = plans[(stage, 1, "zero", 1)].analysis.memory_per_device
    two = plans[(stage, 2, "zero", 1)].analysis.memory_per_device
    assert two.argument_bytes <= one.argument_bytes
    assert two.peak_estimate_bytes <= one.peak_estimate_bytes, (stage, one, two)


def test_plan_shows_the_dcn_bytes_beside_the_formula(plans):
    """`plan`'s table and JSON give each stage's DCN bytes per chip: the program's, and the
    formula's beside them."""
    stage = plans[(2, 2, "zero", 1)]
    run, target, _ = _staged(2, 2)
    result = Plan(run, PlanConfig(devices=16), (stage,), target.compiler_name, 16.0)
    table = format_plan(result)
    program, formula = stage.dcn_program.total, stage.dcn_formula.total
    assert "DCN bytes per chip per step (formula)" in table
    assert f"{format_bytes(program)} ({format_bytes(formula)}) |" in table
    dcn = result.to_json()["stages"][0]["dcn_bytes_per_step"]
    assert dcn["program"]["total"] == program and dcn["formula"]["total"] == formula


@pytest.mark.slow
def test_diloco_replicas_hand_dcn_only_the_outer_step_s_delta_shard(plans):
    """Replicas that step on their own (DiLoCo, a replica per slice) cross DCN only in the
    outer step: Δ in fp32, each chip its shard, all-reduced between the slices."""
    plan = plans[(2, 2, "diloco", 1)]
    assert plan.dcn_formula.total == 0 and plan.dcn_program.total < 0.01 * 1e6
    outer = dcn_program_bytes(plan.analysis.replica_sync.outer_collective_ops)
    formula = outer_dcn_formula_bytes(get_stage(2), plan.analysis.parameters, "float32", 8)
    assert outer.all_reduce == pytest.approx(formula.all_reduce, rel=0.05), (outer, formula)
