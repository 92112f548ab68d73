"""What one compiled train step costs: memory per device, FLOPs, collectives (step_analysis.json)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from t5scale.analysis.collective_ops import CollectiveOp, Collectives
from t5scale.analysis.flops import training_flops_per_step
from t5scale.analysis.hlo import collective_ops, mesh_axes
from t5scale.analysis.hlo_module import parse_module
from t5scale.analysis.kernels import read_program
from t5scale.analysis.memory import ModelStateBytes, compiled_memory
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
)
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.layout import StateLayout


@dataclasses.dataclass(frozen=True)
class SyncSettings:
    """How replicas synchronise, as the analysis records it (ReplicaSyncConfig's settings:
    t5scale/train/replicas.py)."""

    mode: str
    every: int | None = None  # local SGD, DiLoCo: the outer step's settings
    outer_learning_rate: float | None = None
    outer_momentum: float | None = None
    outer_dtype: str | None = None

    @property
    def local(self) -> bool:
        return self.every is not None


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What `analyze_step` reads besides the compiled programs: the run's shape and what its
    state holds per device under its shardings, known before compiling (t5scale/train/setup.py,
    Setup.step_shape, makes it)."""

    model: ModelConfig  # as compiled: attention and scan as the target runs them
    layout: StateLayout
    batch_size: int
    micro_batches: int
    lengths: tuple[int, int]  # input, target
    precision: StatePrecision
    state_bytes: ModelStateBytes  # global, in the model's shapes: what the ZeRO formula divides
    batch_bytes_per_device: int
    parameters_and_optimizer_bytes_per_device: int  # under the state's at-rest shardings
    gradient_bytes_per_device: int
    outer_state_bytes_per_device: int | None  # local SGD, DiLoCo: the anchor and its momentum
    sync: SyncSettings
    platform: str  # Target.platform: 'cpu', 'gpu' or 'tpu'
    compiler: str  # Target.compiler_name

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * sum(self.lengths)


def analyze_step(
    compiled,
    shape: StepShape,
    compile_time_s: float | None = None,
    outer_step=None,
    remat: RematChoice | None = None,
) -> StepAnalysis:
    """Memory (XLA's analysis and the ZeRO formula), FLOPs and collectives of `compiled`, the
    train step of a run of `shape`, and with local SGD or DiLoCo of its compiled `outer_step`.
    `remat`: an 'auto' choice (Setup.choose_remat); without one, the model's own policy. Each
    program's text is parsed once: its collectives and its kernels are read from one Module."""
    model, layout = shape.model, shape.layout
    memory = compiled_memory(compiled)
    flops = training_flops_per_step(model, shape.batch_size, *shape.lengths)
    cost = compiled.cost_analysis() or {}  # None from XLA:GPU's deviceless compiles
    module = parse_module(compiled.as_text())
    ops, collectives = collective_ops(module)
    return StepAnalysis(
        model=model.name,
        zero_stage=layout.stage.number,
        mesh=dict(layout.mesh.shape),
        devices=layout.mesh.size,
        batch_size=shape.batch_size,
        micro_batches=shape.micro_batches,
        tokens_per_step=shape.tokens_per_step,
        lengths=shape.lengths,
        backend=shape.platform,
        compile_time_s=compile_time_s,
        parameters=shape.state_bytes.count,
        precision=shape.precision,
        padded=layout.padded,
        memory_per_device=memory,
        model_state_per_device=model_state_per_device(shape, memory),
        flops_per_step=FlopsPerStep(flops, flops / layout.mesh.size, float(cost.get("flops", 0.0))),
        collectives=collectives,
        collective_ops=tuple(ops),
        layers=Layers(model.num_encoder_layers, model.num_decoder_layers),
        replica_sync=dataclasses.replace(
            replica_sync(shape.sync, dict(layout.mesh.shape), ops, outer_step),
            outer_state_bytes_per_device=shape.outer_state_bytes_per_device,
        ),
        remat=remat or RematChoice(requested=model.remat, policy=model.remat),
        compiler=shape.compiler,
        attention=model.attention,
        scan_layers=model.scan_layers,
        program=read_program(module) if shape.platform in ("gpu", "tpu") else None,
    )


def model_state_per_device(shape: StepShape, memory: MemoryPerDevice) -> ModelStatePerDevice:
    """Parameters, gradients and optimizer state per device: from XLA's memory analysis of the
    step, under the state's shardings, and by the ZeRO formula."""
    layout = shape.layout
    return ModelStatePerDevice(
        xla_parameters_and_optimizer_bytes=memory.argument_bytes - shape.batch_bytes_per_device,
        sharded_parameters_and_optimizer_bytes=shape.parameters_and_optimizer_bytes_per_device,
        gradient_bytes=shape.gradient_bytes_per_device,
        zero_formula_bytes=shape.state_bytes.per_device(layout.stage, layout.zero_size),
        zero_formula=shape.state_bytes.formula(layout.stage),
    )


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
    sync: SyncSettings, mesh: dict[str, int], inner_ops: Sequence[CollectiveOp], outer_step
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

    inner = totals(inner_ops)
    synchronous = ReplicaSync(
        mode=sync.mode, every=sync.every, outer_learning_rate=sync.outer_learning_rate,
        outer_momentum=sync.outer_momentum, inner_step=inner,
        per_step=inner.plus(SyncBytes(0, 0), 1),  # float bytes, as where an outer step adds
    )  # fmt: skip
    if outer_step is None:
        return synchronous
    outer_ops, _ = collective_ops(parse_module(outer_step.as_text()))
    outer = totals(outer_ops)
    return dataclasses.replace(
        synchronous,
        outer_dtype=sync.outer_dtype,
        # the outer step's totals per kind, without the notes the step's own carry
        outer_step=OuterStep(outer.bytes, outer.bytes_over_replica, Collectives.of(outer_ops)),
        outer_collective_ops=tuple(outer_ops),
        per_step=inner.plus(outer, sync.every),
    )
