"""Each ZeRO stage, shown from the compiled step on 8 emulated devices: shardings, collectives,
per-device memory (XLA's analysis) against the ZeRO formula."""

import functools

import jax
import pytest
from conftest import tiny_setup
from jax.sharding import PartitionSpec as P

from t5scale.analysis.hlo import collective_stats
from t5scale.analysis.hlo_module import parse_module
from t5scale.analysis.memory import (
    compiled_memory,
    model_state_bytes,
    per_device_bytes,
    zero3_collective_bytes,
)
from t5scale.data.config import DataConfig
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.parallel.zero import STAGES, get_stage
from t5scale.train.optim import OptimizerConfig

# Big enough that model state, not activations, dominates memory: the stages must show.
MODEL = ModelConfig(vocab_size=4096, d_model=128, d_ff=256, num_heads=4, d_kv=32)
DATA = DataConfig(input_length=32, target_length=16)
BATCH, MICRO_BATCHES = 16, 2


def _compile(stage: int):
    setup = tiny_setup(
        ParallelConfig(zero_stage=stage, zero=8), model=MODEL, data=DATA, batch_size=BATCH,
        micro_batches=MICRO_BATCHES, optimizer=OptimizerConfig(grad_clip_norm=None),
    )  # fmt: skip
    compiled = setup.compile().compiled
    batch = setup.abstract_batch()
    batch_bytes = sum(x.size * 4 for x in jax.tree.leaves(batch)) // 8
    return {
        "state": setup.state,
        "compiled": compiled,
        "grad_shardings": setup.layout.grad_shardings,
        "collectives": collective_stats(parse_module(compiled.as_text())),
        "memory": compiled_memory(compiled),
        "batch_bytes": batch_bytes,
    }


@functools.cache  # per process: under xdist a module's tests may interleave with others'
def _all_stages():
    return {stage.number: _compile(stage.number) for stage in STAGES}


@pytest.fixture
def stages():
    return _all_stages()


def _has_zero(spec: P) -> bool:
    return any(e == "zero" or (isinstance(e, tuple) and "zero" in e) for e in spec)


def _zero_sharded(shardings) -> set[bool]:
    return {_has_zero(s.spec) for s in jax.tree.leaves(shardings) if len(s.spec)}


@pytest.mark.parametrize("stage", range(4))
def test_shardings_are_those_of_the_table(stages, stage):
    row, got = get_stage(stage), stages[stage]
    state_in, _ = got["compiled"].input_shardings[0]
    state_out, _ = got["compiled"].output_shardings
    # Parameters in and out of the step, optimizer state likewise (Adam's moments).
    assert _zero_sharded(state_in.params) == {row.shard_parameters}
    assert _zero_sharded(state_out.params) == {row.shard_parameters}
    moments = state_in.opt_state[0].mu
    assert _zero_sharded(moments) == {row.shard_optimizer_state}
    # Gradients: where the step keeps them (its collectives, below, show them reduced there).
    assert _zero_sharded(got["grad_shardings"]) == {row.shard_gradients}


@pytest.mark.parametrize("stage", range(4))
def test_the_compiled_step_runs_the_collectives_of_the_table(stages, stage):
    row, found = get_stage(stage), stages[stage]["collectives"]
    assert row.gradient_collective in found
    other = {"all-reduce": "reduce-scatter", "reduce-scatter": "all-reduce"}[
        row.gradient_collective
    ]
    gradients = model_state_bytes(stages[stage]["state"].params, {}).gradients
    # The other kind carries no gradient: at most the scalars (loss sums, the norm).
    assert found.get(other, {"bytes": 0})["bytes"] < 0.01 * gradients
    if row.parameter_collective:
        assert row.parameter_collective in found
    else:
        assert "all-gather" not in found


def test_stage0_and_stage1_all_reduce_gradients(stages):
    for stage in (0, 1):
        found = stages[stage]["collectives"]
        assert "reduce-scatter" not in found
        # XLA combines per-leaf all-reduces into tuples, so bytes, not counts, show the gradient.
        assert (
            found["all-reduce"]["bytes"]
            >= model_state_bytes(stages[stage]["state"].params, {}).gradients
        )
    assert "all-gather" not in stages[0]["collectives"]  # stage 0 has no parameter collective
    # Stage 1: the parameters are all-gathered after the sharded update.
    assert (
        stages[1]["collectives"]["all-gather"]["bytes"]
        >= 0.9 * model_state_bytes(stages[1]["state"].params, {}).parameters
    )


def test_stage2_reduce_scatters_each_micro_batch_and_gathers_after_the_update(stages):
    found, grad_bytes = (
        stages[2]["collectives"],
        model_state_bytes(stages[2]["state"].params, {}).gradients,
    )
    # Every micro-batch's gradients are reduce-scattered into the 1/N accumulator.
    assert found["reduce-scatter"]["operand_bytes"] >= 0.9 * MICRO_BATCHES * grad_bytes
    assert found["all-gather"]["bytes"] >= 0.9 * grad_bytes  # parameters after the update
    # Whatever all-reduce remains is scalars (loss sums, the norm), not gradients.
    assert found.get("all-reduce", {"bytes": 0})["bytes"] < 0.01 * grad_bytes


def test_stage3_gathers_parameters_before_each_use_and_reduce_scatters_gradients(stages):
    got = stages[3]
    found, params = got["collectives"], got["state"].params
    gathered, scattered = zero3_collective_bytes(params, MODEL, DATA, BATCH, MICRO_BATCHES)
    assert 0.95 * gathered <= found["all-gather"]["bytes"] <= 1.05 * gathered
    assert 0.95 * scattered <= found["reduce-scatter"]["operand_bytes"] <= 1.05 * scattered
    layers = model_state_bytes(
        [params["encoder"]["layers"], params["decoder"]["layers"]], {}
    ).parameters
    assert found.get("all-reduce", {"bytes": 0})["bytes"] < 0.01 * layers


def test_memory_per_device_falls_from_stage_0_to_stage_3(stages):
    peaks = [stages[s]["memory"].peak_estimate_bytes for s in range(4)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks


@pytest.mark.parametrize("stage", range(4))
def test_model_state_memory_agrees_with_the_zero_formula(stages, stage):
    got = stages[stage]
    params_and_optimizer = got["memory"].argument_bytes - got["batch_bytes"]
    # The gradients' shards where the step keeps them (a compiled gradient function's output
    # bytes were these same shard sizes: its out_shardings were these).
    gradients = per_device_bytes(got["state"].params, got["grad_shardings"])
    formula = model_state_bytes(got["state"].params, got["state"].opt_state).per_device(
        get_stage(stage), 8
    )
    measured = params_and_optimizer + gradients
    assert abs(measured - formula.total) <= 0.10 * formula.total, (measured, formula)
