"""One path from a run's configuration to its compiled train step.

    setup = build_setup(run)          # mesh, optimizer, the state's form (layout, precision,
                                      # replica sync, abstract state): nothing allocated, nothing
                                      # compiled
    step = setup.compile()            # the compiled one-step program and its analysis
    state = setup.create_state()      # parameters and optimizer state, in their shardings

The training loop, the study's trials, the planner, the cluster model, the benchmarks and the
tests all start here, so a change to how a step is built is made once.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from t5scale.analysis.memory import compiled_memory, device_memory_budget, per_device_bytes
from t5scale.analysis.records import RematChoice, RematTry, StatePrecision, StepAnalysis
from t5scale.analysis.step import StepShape, SyncSettings, analyze_step
from t5scale.data.batch import Batch
from t5scale.data.synthetic import batch_shapes
from t5scale.errors import ConfigError
from t5scale.model.sizes import REMAT_LADDER, attention_for
from t5scale.parallel.mesh import data_parallel_size, make_mesh
from t5scale.target import Target
from t5scale.train import fp8, optim
from t5scale.train.config import RunConfig
from t5scale.train.metrics import StepMetrics
from t5scale.train.state import StateForm, TrainState, build_form
from t5scale.train.step import (
    batch_sharding,
    make_eval_step,
    make_outer_step,
    make_train_step,
    stack_batches,
    working_copy,
)


def check_batch(run: RunConfig, mesh: Mesh) -> None:
    """A ConfigError unless the global batch splits over the data-parallel devices and the
    micro-batches."""
    stages, micro_batches = run.parallel.pipeline, run.train.micro_batches
    if stages > 1 and micro_batches % stages:
        raise ConfigError(
            f"pipeline={stages} needs micro_batches a multiple of it (each stage computes the "
            f"loss of micro_batches/pipeline of them), got micro_batches={micro_batches}"
        )
    if stages > 1 and run.sync.local:
        raise ConfigError(
            f"pipeline={stages} with ReplicaSyncConfig.mode={run.sync.mode!r}: replicas that "
            "step on their own are not pipelined; use mode 'every_step'"
        )
    data_parallel = data_parallel_size(mesh)
    needed = data_parallel * micro_batches
    if run.train.batch_size % needed:
        raise ConfigError(
            f"global batch {run.train.batch_size} is not divisible by data-parallel size "
            f"{data_parallel} × micro_batches {run.train.micro_batches} = {needed}"
        )


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A compiled train step (`steps_per_execution` steps per execution) and what it costs.
    With remat 'auto', `setup` is the one with the policy chosen, and `remat` says how."""

    setup: Setup
    compiled: Any  # jax.stages.Compiled: (state, batch) → (state, metrics)
    steps_per_execution: int
    compile_time_s: float
    remat: RematChoice | None = None  # how remat 'auto' chose; None: the run's own policy

    @functools.cached_property
    def analysis(self) -> StepAnalysis:
        """step_analysis.json: memory per device, FLOPs, collectives (t5scale/analysis/step.py)."""
        setup = self.setup
        outer = setup.compiled_outer.compiled if setup.run.sync.local else None
        return analyze_step(
            self.compiled, setup.step_shape(), self.compile_time_s, outer, self.remat
        )

    def execute(self, state: TrainState, batch: Any, done: int) -> tuple[TrainState, StepMetrics]:
        """(state, metrics) after one execution: the steps after `done` (`batch`: their batches,
        stacked when there are several). With local SGD or DiLoCo, the outer step follows where
        it is due after them, and the replicas' metrics come back combined, on the host: one
        value per step."""
        state, metrics = self.compiled(state, batch)
        sync = self.setup.run.sync
        if not sync.local:
            return state, metrics
        if sync.due(done + self.steps_per_execution):
            state = self.setup.compiled_outer.compiled(state)
        # Each replica's metrics live on its own devices (another process's, across hosts).
        return state, multihost_utils.process_allgather(metrics, tiled=True).over_replicas()


def _of_form(name: str, doc: str) -> property:
    """A read-only attribute of Setup that is its form's `name`."""
    return property(lambda setup: getattr(setup.form, name), doc=doc)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything a train step needs, derived from one RunConfig for one compile target: the
    mesh over its devices, the optimizer and the state's form (t5scale/train/state.py)."""

    run: RunConfig
    mesh: Mesh
    form: StateForm
    target: Target

    # The form's parts a step is built from, as every caller reads them.
    layout = _of_form("layout", "The stage's layout of parameters, gradients, optimizer state.")
    precision = _of_form("precision", "The dtypes the state is kept in.")
    state = _of_form("state", "The abstract state in its at-rest shardings: what steps take.")

    def batch_sharding(self, stacked: bool = False) -> NamedSharding:
        return batch_sharding(self.layout, stacked)

    def abstract_batch(self, steps: int = 1) -> Batch:
        """The global batch's shapes and sharding (`steps` > 1: that many stacked), to compile
        the step before any data arrive."""
        stack = (steps,) if steps > 1 else ()
        sharding = self.batch_sharding(steps > 1)
        return batch_shapes(self.run.data, self.run.train.batch_size).map(
            lambda shape: jax.ShapeDtypeStruct(stack + shape, np.int32, sharding=sharding)
        )

    def stack(self, batches: list[Batch]) -> Batch:
        """Global batches stacked for a program of len(batches) steps per execution."""
        return stack_batches(batches, self.layout)

    def train_step(self, steps_per_execution: int = 1):
        """The jitted (not yet compiled) step; NaN or Inf as CheckpointConfig.on_nonfinite says.
        With remat 'auto', that of the policy `compile` chooses (CompiledStep.setup)."""
        if self.run.model.remat == "auto":
            raise ConfigError("remat 'auto' is chosen by Setup.compile: use its step's setup")
        return make_train_step(
            self.run.model, self.layout, self.form.tx, self.run.train, self.form.shardings,
            self.precision,
            skip_nonfinite=self.run.checkpoint.on_nonfinite == "skip",
            steps_per_execution=steps_per_execution,
        )  # fmt: skip

    def compile(
        self, steps_per_execution: int = 1, memory_budget_bytes: int | None = None
    ) -> CompiledStep:
        """The step compiled from abstract shapes in their shardings (nothing allocated).
        step_analysis.json and memory checks use the one-step program: XLA's memory analysis of
        the k-step loop can under-count its temporaries (docs/benchmarks.md). With remat
        'auto', the policy is chosen first (`choose_remat`, within `memory_budget_bytes`)."""
        if self.run.model.remat == "auto":
            chosen = self.choose_remat(memory_budget_bytes)
            if steps_per_execution == 1:
                return chosen
            step = chosen.setup.compile(steps_per_execution)
            return dataclasses.replace(step, remat=chosen.remat)
        started = time.perf_counter()
        lowered = self.train_step(steps_per_execution).lower(
            self.state, self.abstract_batch(steps_per_execution)
        )
        with self.target.compiling():
            compiled = lowered.compile(compiler_options=self.target.compiler_options)
        elapsed = time.perf_counter() - started
        return CompiledStep(self, compiled, steps_per_execution, elapsed)

    def with_remat(self, policy: str) -> Setup:
        """The same setup with the layers' remat policy replaced (nothing else depends on it)."""
        model = dataclasses.replace(self.run.model, remat=policy)
        return dataclasses.replace(self, run=dataclasses.replace(self.run, model=model))

    def choose_remat(self, memory_budget_bytes: int | None = None) -> CompiledStep:
        """The one-step program of the cheapest policy of REMAT_LADDER whose compiled peak fits
        `memory_budget_bytes` (default: the devices' memory, `device_memory_budget`), else the
        last one's; every process takes the same one (the most frugal any of them needs)."""
        budget = memory_budget_bytes or device_memory_budget(self.mesh)
        tried = []
        for index, policy in enumerate(REMAT_LADDER):
            step = self.with_remat(policy).compile()
            peak = compiled_memory(step.compiled).peak_estimate_bytes
            tried.append(RematTry(policy, peak))
            if peak <= budget or index == len(REMAT_LADDER) - 1:
                break
        agreed = _most_frugal(index)
        if agreed != index:
            step = self.with_remat(REMAT_LADDER[agreed]).compile()
            peak = compiled_memory(step.compiled).peak_estimate_bytes
        choice = RematChoice(requested="auto", policy=REMAT_LADDER[agreed], budget_bytes=budget,
                             fits=peak <= budget, tried=tuple(tried))  # fmt: skip
        return dataclasses.replace(step, remat=choice)

    def step_shape(self) -> StepShape:
        """What the analysis of this setup's compiled step reads besides the program: the run's
        shape and what its state holds per device (t5scale/analysis/step.py)."""
        run, form, layout, precision = self.run, self.form, self.layout, self.precision
        batch = self.abstract_batch()
        scattered = layout.stage.shard_gradients
        grads = layout.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.at_rest(scattered), precision.grad_dtype)
        )
        state, shardings = self.state, form.shardings
        sync = run.sync
        return StepShape(
            model=run.model, layout=layout, batch_size=run.train.batch_size,
            micro_batches=run.train.micro_batches,
            lengths=(run.data.input_length, run.data.target_length),
            precision=StatePrecision(precision.name, precision.param_dtype.name,
                                     precision.grad_dtype.name, precision.mixed),
            state_bytes=form.model_state_bytes(),
            batch_bytes_per_device=per_device_bytes(
                batch, batch.map(lambda x: x.sharding)
            ),
            parameters_and_optimizer_bytes_per_device=per_device_bytes(  # and the FP8 state
                (state.params, state.opt_state, state.fp8),
                (shardings.params, shardings.opt_state, shardings.fp8),
            ),
            gradient_bytes_per_device=per_device_bytes(grads, layout.grad_shardings),
            outer_state_bytes_per_device=(
                None if state.outer is None else per_device_bytes(state.outer, shardings.outer)
            ),
            sync=SyncSettings(
                mode=sync.mode, every=sync.every, outer_dtype=sync.outer_dtype,
                outer_learning_rate=sync.outer_sgd.learning_rate,
                outer_momentum=sync.outer_sgd.momentum,
            ) if sync.local else SyncSettings(mode=sync.mode),
            platform=self.target.platform,
            compiler=self.target.compiler_name,
        )  # fmt: skip

    @functools.cached_property
    def outer_step(self):
        """The jitted outer step of local SGD or DiLoCo (t5scale/train/replicas.py)."""
        form = self.form
        return make_outer_step(
            form.layout, form.precision, self.run.sync, form.outer_tx, form.shardings
        )

    @functools.cached_property
    def compiled_outer(self) -> CompiledStep:
        """The outer step compiled from abstract shapes (local SGD, DiLoCo)."""
        started = time.perf_counter()
        lowered = self.outer_step.lower(self.state)
        with self.target.compiling():
            compiled = lowered.compile(compiler_options=self.target.compiler_options)
        return CompiledStep(self, compiled, 1, time.perf_counter() - started)

    @functools.cached_property
    def _anchor_params(self):
        convert = functools.partial(working_copy, self.layout, self.precision)
        return jax.jit(convert, out_shardings=self.layout.param_shardings)

    def model_params(self, state: TrainState) -> Any:
        """The parameters to evaluate, in the stage's layout: the state's own, or with local SGD
        and DiLoCo the synchronised ones (the anchor, as of the last outer step)."""
        if not self.run.sync.local:
            return state.params
        return self._anchor_params(state.outer.anchor)

    def eval_step(self):
        return make_eval_step(self.run.model, self.layout, self.run.train.z_loss)

    def create_state(self, seed: int | None = None) -> TrainState:
        """Fresh parameters and optimizer state straight in their at-rest shardings (seed:
        TrainConfig.seed unless given); the same values on every stage and mesh."""
        seed = self.run.train.seed if seed is None else seed
        state = self.form.create(jax.random.key(seed))
        # Wait: on XLA's CPU backend two multi-device programs running at once can meet in the
        # same collective rendezvous and abort (seen with the init and the first ZeRO-3 step).
        return jax.block_until_ready(state)

    def compile_state_init(self) -> None:
        """Compile (not run) the state's init, so that a persistent compilation cache holds it."""
        with self.target.compiling():
            self.form.compile_create(
                jax.random.key(self.run.train.seed), self.target.compiler_options
            )


def _most_frugal(index: int) -> int:
    """The largest of the processes' remat choices (an index into REMAT_LADDER): they must
    compile the same program."""
    if jax.process_count() == 1:
        return index
    return int(np.max(multihost_utils.process_allgather(np.int32(index))))


def build_setup(run: RunConfig, target: Target | list | None = None) -> Setup:
    """The mesh over the `target`'s devices (a Target, a list of devices, or None: all devices
    at hand), the optimizer and the state's form (the stage's layout, the precision, the
    replica sync, the abstract state in its shardings); a ConfigError or MeshError in one
    line where the run cannot be laid out on them."""
    target = Target.of(target)
    if run.precision.mode == "fp8":
        fp8.check_supported(target.platform, run.sync.local)
    mesh = make_mesh(run.parallel, list(target.devices))
    run = dataclasses.replace(run, model=attention_for(run.model, target.fused_kernels))
    check_batch(run, mesh)
    tx = optim.make_optimizer(run.optimizer)
    return Setup(run, mesh, build_form(run, mesh, tx), target)
