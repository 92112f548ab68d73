"""What one compiled train step costs: memory per device, FLOPs, collectives (step_analysis.json)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from t5scale.analysis.collectives import CollectiveOp, Collectives
from t5scale.analysis.flops import training_flops_per_step
from t5scale.analysis.hlo import collective_ops, mesh_axes
from t5scale.analysis.kernels import gpu_program
from t5scale.analysis.memory import compiled_memory, per_device_bytes
from t5scale.analysis.records import (
    FlopsPerStep,
    Layers,
    MemoryPerDevice,
    ModelStatePerDevice,
    OuterStep,
    RematChoice,
    ReplicaSync,
    StatePrecision,
    StepAnalysis,
    SyncBytes,
    ZeroFormulaBytes,
)
from t5scale.xla_gpu import compiler_name


def analyze_step(
    compiled,
    setup,
    compile_time_s: float | None = None,
    outer_step=None,
    remat: Mapping[str, Any] | None = None,
) -> StepAnalysis:
    """Memory (XLA's analysis and the ZeRO formula), FLOPs and collectives of `compiled`, the
    train step of `setup` (a t5scale.train.setup.Setup), and with local SGD or DiLoCo of its
    compiled `outer_step`. `remat`: Setup.choose_remat's record of an 'auto' choice; without
    one, the run's own policy."""
    run, layout, precision = setup.run, setup.layout, setup.precision
    memory = MemoryPerDevice(**compiled_memory(compiled))
    flops = training_flops_per_step(
        run.model, run.train.batch_size, run.data.input_length, run.data.target_length
    )
    cost = compiled.cost_analysis() or {}  # None from XLA:GPU's deviceless compiles
    text = compiled.as_text()
    ops, collectives = collective_ops(text)
    gpu = layout.mesh.devices.flat[0].platform == "gpu"
    policy = run.model.remat
    return StepAnalysis(
        model=run.model.name,
        zero_stage=layout.stage.number,
        mesh=dict(layout.mesh.shape),
        devices=layout.mesh.size,
        batch_size=run.train.batch_size,
        micro_batches=run.train.micro_batches,
        tokens_per_step=run.tokens_per_step,
        lengths=(run.data.input_length, run.data.target_length),
        backend=layout.mesh.devices.flat[0].platform,
        compile_time_s=compile_time_s,
        parameters=setup.form.model_state_bytes().count,
        precision=StatePrecision(
            precision.name, precision.param_dtype.name, precision.grad_dtype.name, precision.mixed
        ),
        padded=layout.padded,
        memory_per_device=memory,
        model_state_per_device=model_state_per_device(setup, memory),
        flops_per_step=FlopsPerStep(flops, flops / layout.mesh.size, float(cost.get("flops", 0.0))),
        collectives=collectives,
        collective_ops=tuple(ops),
        layers=Layers(run.model.num_encoder_layers, run.model.num_decoder_layers),
        replica_sync=dataclasses.replace(
            replica_sync(run.sync, dict(layout.mesh.shape), ops, outer_step),
            outer_state_bytes_per_device=outer_state_bytes(setup.state, setup.form.shardings),
        ),
        remat=RematChoice.from_json(remat or {"requested": policy, "policy": policy}),
        compiler=compiler_name(layout.mesh.devices.flat),
        attention=run.model.attention,
        scan_layers=run.model.scan_layers,
        gpu_program=gpu_program(text) if gpu else None,
    )


def model_state_per_device(setup, memory: MemoryPerDevice) -> ModelStatePerDevice:
    """Parameters, gradients and optimizer state per device: from XLA's memory analysis of the
    step, under the state's shardings, and by the ZeRO formula."""
    layout, state, shardings = setup.layout, setup.state, setup.form.shardings
    batch = setup.abstract_batch()
    batch_per_device = per_device_bytes(batch, {name: x.sharding for name, x in batch.items()})
    params_opt = per_device_bytes(
        (state.params, state.opt_state), (shardings.params, shardings.opt_state)
    )
    scattered = layout.stage.shard_gradients
    grads = layout.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.at_rest(scattered), setup.precision.grad_dtype)
    )
    state_bytes = setup.form.model_state_bytes()
    return ModelStatePerDevice(
        xla_parameters_and_optimizer_bytes=memory.argument_bytes - batch_per_device,
        sharded_parameters_and_optimizer_bytes=params_opt,
        gradient_bytes=per_device_bytes(grads, layout.grad_shardings),
        zero_formula_bytes=ZeroFormulaBytes(
            **state_bytes.per_device(layout.stage, layout.zero_size)
        ),
        zero_formula=state_bytes.formula(layout.stage),
    )


def outer_state_bytes(state, shardings) -> int | None:
    """Per device: the anchor and outer momentum of local SGD or DiLoCo (sharded over `zero` as
    the optimizer state is), beside the model state above; None when replicas step together."""
    if state.outer is None:
        return None
    return per_device_bytes(state.outer, shardings.outer)


def with_every(analysis: StepAnalysis, every: int) -> StepAnalysis:
    """The analysis of the same step with local SGD's or DiLoCo's outer step every `every`
    steps (the programs do not depend on H)."""
    sync = analysis.replica_sync
    if sync.outer_step is None or sync.every == every:
        return analysis
    outer = SyncBytes(sync.outer_step.bytes, sync.outer_step.bytes_over_replica)
    per_step = sync.inner_step.plus(outer, every)
    sync = dataclasses.replace(sync, every=every, per_step=per_step)
    return dataclasses.replace(analysis, replica_sync=sync)


def replica_sync(
    sync, mesh: dict[str, int], inner_ops: Sequence[CollectiveOp], outer_step
) -> ReplicaSync:
    """How replicas synchronise and what it moves, per device: the step's collective bytes and
    those over `replica`, the outer step's (local SGD, DiLoCo), and both per step (the outer
    step's over H)."""

    def totals(ops: Sequence[CollectiveOp]) -> SyncBytes:
        over_replica = [op for op in ops if "replica" in mesh_axes(op.group, mesh)]
        return SyncBytes(
            sum(op.count * op.bytes for op in ops),
            sum(op.count * op.bytes for op in over_replica),
        )

    inner, described = totals(inner_ops), sync.describe()
    if outer_step is None:
        # float bytes per step, as where an outer step adds its share
        return ReplicaSync(**described, inner_step=inner, per_step=inner.plus(SyncBytes(0, 0), 1))
    outer_ops, _ = collective_ops(outer_step.as_text())
    outer = totals(outer_ops)
    return ReplicaSync(
        **described,
        inner_step=inner,
        outer_dtype=sync.outer_dtype,
        # the outer step's totals per kind, without the notes the step's own carry
        outer_step=OuterStep(outer.bytes, outer.bytes_over_replica, Collectives.of(outer_ops)),
        outer_collective_ops=tuple(outer_ops),
        per_step=inner.plus(outer, sync.every),
    )
