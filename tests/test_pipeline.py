"""Pipeline parallelism (t5scale/train/pipeline.py): numerics against one device, what the
compiled program holds and moves, checkpoints between pipelined and unpipelined runs, bad input."""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest
from conftest import (
    TINY_ARGS,
    assert_same_parameters,
    cli_inline,
    run_steps,
    synthetic_batches,
    tiny_setup,
    train_tiny,
)

from t5scale.analysis.hlo import collective_ops, mesh_axes
from t5scale.analysis.hlo_module import parse_module
from t5scale.analysis.kernels import read_program
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.checkpoint import Checkpoints, saved_meta
from t5scale.train.config import CheckpointConfig
from t5scale.train.pipeline import bubble_fraction, ticks
from t5scale.train.precision import PrecisionConfig

# mt5_tiny's dimensions with 4 layers a stack, so that 4 stages hold one each.
MODEL = ModelConfig(vocab_size=1024, num_encoder_layers=4, num_decoder_layers=4)
STEPS = 3
LAYOUTS = {
    "pipeline2": (ParallelConfig(pipeline=2, zero=4), 2),
    "pipeline4": (ParallelConfig(pipeline=4, zero=2), 4),
    "pipeline2-zero1-tensor2": (ParallelConfig(zero_stage=1, pipeline=2, zero=2, tensor=2), 2),
    "pipeline4-zero1": (ParallelConfig(zero_stage=1, pipeline=4, zero=2), 4),
    # Tensor × pipeline with no data parallelism (the layout of NeMo's large T5s).
    "pipeline4-tensor2": (ParallelConfig(zero_stage=1, replica=1, pipeline=4, zero=1, tensor=2), 4),
    "pipeline2-replica2-zero1": (ParallelConfig(zero_stage=1, replica=2, pipeline=2, zero=2), 2),
}


@functools.cache
def _one_device():
    return train_tiny(ParallelConfig(), devices=1, steps=STEPS, model=MODEL)


@functools.cache
def _compiled(name: str):
    """(setup, compiled step) of a layout of LAYOUTS: the numerics and the HLO tests share it."""
    parallel, micro_batches = LAYOUTS[name]
    setup = tiny_setup(parallel, model=MODEL, micro_batches=micro_batches)
    return setup, setup.compile()


# In CI: 2 stages (the HLO tests below read 4 stages' program); the rest of LAYOUTS is slow.
IN_CI = ("pipeline2",)


@pytest.mark.parametrize(
    "name", [name if name in IN_CI else pytest.param(name, marks=pytest.mark.slow)
             for name in LAYOUTS],
)  # fmt: skip
def test_a_pipeline_trains_like_one_device(name):
    base_losses, base_params = _one_device()
    setup, step = _compiled(name)
    state, losses = run_steps(setup, setup.create_state(seed=0), 0, STEPS - 1, step.compiled)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    assert_same_parameters(jax.device_get(setup.form.to_canonical(state).params), base_params)


def _stack_parameters(model: ModelConfig) -> int:
    setup = tiny_setup(ParallelConfig(), devices=1, model=model)
    leaves = jax.tree_util.tree_leaves_with_path(setup.state.params)
    return sum(x.size for path, x in leaves if "layers" in jax.tree_util.keystr(path))


def test_each_device_holds_its_stages_layers_and_moves_activations_by_permutes_only():
    setup, step = _compiled("pipeline4")
    stages, micro_batches = 4, 4
    # Parameters per device: the stacks over the stages, everything else whole (stage 0).
    whole = tiny_setup(ParallelConfig(), devices=1, model=MODEL).layout.parameters_per_device()
    stacks = _stack_parameters(MODEL)
    assert setup.layout.parameters_per_device() == whole - stacks + stacks // stages
    assert setup.layout.parameters_per_device() < 0.7 * whole

    ops, _ = collective_ops(parse_module(step.compiled.as_text()))
    mesh = dict(setup.mesh.shape)
    permutes = [op for op in ops if op.kind == "collective-permute"]
    assert permutes and all(mesh_axes(op.group, mesh) == {"pipeline"} for op in permutes)
    # Nothing else crosses stages: every other collective stays within one stage's devices.
    others = [op for op in ops if op.kind != "collective-permute"]
    crossing = [op for op in others if "pipeline" in mesh_axes(op.group, mesh) and op.bytes > 8]
    # ... but for the gradient sums of what every stage uses (embedding, norms, head, tables).
    assert all(op.kind == "all-reduce" for op in crossing), crossing

    # Bytes: micro-batch × length × d_model per boundary per micro-batch, one permute a tick.
    d, (input_length, target_length) = 64, (32, 16)
    rows = setup.run.train.batch_size // (mesh["replica"] * mesh["zero"]) // micro_batches
    encoder_bytes, decoder_bytes = (rows * n * d * 4 for n in (input_length, target_length))
    in_schedule = [op for op in permutes if op.loops]
    tick_count = ticks(stages, micro_batches)
    assert {op.loops for op in in_schedule} == {(tick_count,)}
    forward = [op for op in in_schedule if "transpose" not in op.loop_names[0]]
    # The encoder's phase moves its activations; the decoder's its own and the encoder's output.
    assert sorted(op.bytes for op in forward) == sorted(
        [encoder_bytes, decoder_bytes, encoder_bytes]
    )
    # The head's share: stage 0 sends M/PP micro-batches of the decoder's output to each other.
    spread = [op for op in permutes if not op.loops and "transpose" not in op.computation]
    assert len(spread) >= stages - 1

    # The idle fraction from the program: each phase's loop runs `trips` ticks and each tick
    # moves `rows` of the local batch's rows, so the program does batch/rows micro-batches in
    # `trips` ticks.
    local_rows = setup.run.train.batch_size // (mesh["replica"] * mesh["zero"])
    trips = forward[0].loops[0]
    done = local_rows // (forward[0].bytes // (input_length * d * 4))
    idle = (trips - done) / trips
    assert idle == pytest.approx(bubble_fraction(stages, micro_batches)) == 3 / 7


def test_the_idle_ticks_are_in_the_programs_matmuls():
    """The compiled schedule's matmul FLOPs against the same work unpipelined: a stage runs
    its layers on M + PP − 1 micro-batches for M of real work, and the head on M/PP of them."""
    setup, step = _compiled("pipeline4")
    stages, micro_batches = 4, 4
    flat = tiny_setup(ParallelConfig(zero=2), devices=2, model=MODEL)  # the same local batch
    piped = read_program(parse_module(step.compiled.as_text())).inventory.gemm.flops
    whole = read_program(parse_module(flat.compile().compiled.as_text())).inventory.gemm.flops
    # The output projection's matmuls, forward and backward, on the local batch's targets.
    rows = setup.run.train.batch_size // setup.mesh.shape["zero"]
    head = 3 * 2 * rows * 16 * MODEL.d_model * MODEL.vocab_size
    layers_ratio = (piped * stages - head) / (whole - head)  # = ticks / micro-batches
    idle = 1 - 1 / layers_ratio
    assert idle == pytest.approx(bubble_fraction(stages, micro_batches), rel=1e-6)


def test_a_pipelined_checkpoint_restores_unpipelined_and_back_exactly(tmp_path):
    pipelined, _ = _compiled("pipeline2")
    flat = tiny_setup(ParallelConfig(zero_stage=1, zero=8), model=MODEL)
    step = _compiled("pipeline2")[1].compiled
    state, _ = run_steps(pipelined, pipelined.create_state(seed=0), 0, 1, step)

    def save(directory, setup, state):
        checkpoints = Checkpoints(str(directory), CheckpointConfig(async_save=False))
        meta = saved_meta(setup.run, setup.form, 2, 2)
        checkpoints.save(2, setup.form.to_canonical(state), meta)
        checkpoints.close()

    def restore(directory, setup):
        checkpoints = Checkpoints(str(directory), CheckpointConfig())
        restored = checkpoints.restore_latest(setup.form.restore_target, MODEL, "adamw")
        checkpoints.close()
        return setup.form.from_canonical(restored.state, restored.meta)

    def canonical(setup, state):
        return jax.device_get(setup.form.to_canonical(state))

    save(tmp_path / "pipelined", pipelined, state)
    moved = restore(tmp_path / "pipelined", flat)
    for got, want in zip(jax.tree.leaves(canonical(flat, moved)),
                         jax.tree.leaves(canonical(pipelined, state)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)
    save(tmp_path / "flat", flat, moved)
    back = restore(tmp_path / "flat", pipelined)
    for got, want in zip(jax.tree.leaves(canonical(pipelined, back)),
                         jax.tree.leaves(canonical(pipelined, state)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)
    # And the restored pipelined state trains on as the original does.
    batch = synthetic_batches(pipelined, 2, 2)[0]
    _, original = step(state, batch)
    _, again = step(back, batch)
    assert float(original.loss) == float(again.loss)


@pytest.mark.slow  # CI: a pipeline's program, its idle ticks and its checkpoint (in this file)
def test_plan_shows_memory_per_device_per_pipeline_degree(capsys, monkeypatch):
    flags = ["--gin.MICRO_BATCHES=2", "--gin.PlanConfig.pipelines=(1, 2)",
             "--gin.PlanConfig.stages=(1, 2)", "--json"]  # fmt: skip
    code, out, err = cli_inline(["plan", *TINY_ARGS, *flags], capsys, monkeypatch)
    assert code == 0, err
    assert "pipeline 2: ZeRO stages 0 and 1 only" in err
    rows = {(row["pipeline"], row["stage"]): row for row in json.loads(out)["stages"]}
    assert set(rows) == {(1, 1), (1, 2), (2, 1)}
    flat, piped = rows[1, 1], rows[2, 1]
    assert piped["mesh"] == {"replica": 1, "pipeline": 2, "zero": 4, "tensor": 1}
    assert piped["parameters_per_device"] < flat["parameters_per_device"]
    # The ZeRO formula counts a stage's parameters, as XLA's arguments do.
    formula = piped["zero_formula_bytes"]["total"]
    state = piped["xla_model_state_per_device"]
    xla = state["xla_parameters_and_optimizer_bytes"] + state["gradient_bytes"]
    assert formula == pytest.approx(xla, rel=0.02)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--gin.ParallelConfig.pipeline=4", "--gin.MICRO_BATCHES=4"],
            "pipeline=4 does not divide the 2 layers",
        ),
        (
            [
                "--gin.ParallelConfig.pipeline=3",
                "--gin.MICRO_BATCHES=3",
            ],
            "does not divide 8 devices",
        ),  # fmt: skip
        (
            ["--gin.ParallelConfig.pipeline=2", "--gin.MICRO_BATCHES=3"],
            "micro_batches a multiple of it",
        ),  # fmt: skip
        (
            [
                "--gin.ParallelConfig.pipeline=2",
                "--gin_file=gin/zero/stage2.gin",
                "--gin.MICRO_BATCHES=2",
            ],
            "use zero_stage 0 or 1 with a pipeline",
        ),  # fmt: skip
    ],
    ids=["layers", "devices", "micro-batches", "stage-2"],
)
def test_a_pipeline_that_does_not_fit_stops_with_one_line(flags, message, capsys, monkeypatch):
    # The job as its flags give it (plan's own sweep weak-scales `zero` to the devices).
    job = ["plan", *TINY_ARGS, "--gin.PlanConfig.job=True", *flags]
    code, out, err = cli_inline(job, capsys, monkeypatch)
    assert code == 2, (out, err)
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # CI: a pipeline trains like one device in fp32 (above); mixed precision, remat
# and the tiled head each without a pipeline
def test_a_pipeline_composes_with_mixed_precision_remat_and_the_tiled_head():
    model = dataclasses.replace(MODEL, dtype="bfloat16", remat="full", loss_chunk_tokens=8)
    mixed = {"model": model, "precision": PrecisionConfig(mode="mixed"), "steps": STEPS}
    flat, _ = train_tiny(ParallelConfig(zero_stage=1, zero=2), devices=2, micro_batches=2, **mixed)
    piped, _ = train_tiny(LAYOUTS["pipeline2-zero1-tensor2"][0], micro_batches=2, **mixed)
    # bf16 arithmetic in another order: 6e-4 apart here.
    np.testing.assert_allclose(piped, flat, rtol=2e-3)
