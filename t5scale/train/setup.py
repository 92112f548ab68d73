"""One path from a run's configuration to its compiled train step.

    setup = build_setup(run)          # mesh, optimizer, state layout, abstract state: nothing
                                      # allocated, nothing compiled
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
import optax
from jax.sharding import Mesh, NamedSharding

from t5scale.analysis.memory import ModelStateBytes, model_state_bytes
from t5scale.analysis.step import analyze_step
from t5scale.data.synthetic import batch_shapes
from t5scale.model.mt5 import abstract_params
from t5scale.parallel.layout import StateLayout, make_layout
from t5scale.parallel.mesh import data_parallel_size, make_mesh
from t5scale.train import optim
from t5scale.train.config import ConfigError, RunConfig
from t5scale.train.precision import Precision, resolve
from t5scale.train.state import (
    TrainState,
    abstract_state,
    canonical_init,
    canonical_shardings,
    from_canonical,
    initializer,
    state_shardings,
    to_canonical,
    with_shardings,
)
from t5scale.train.step import batch_sharding, make_eval_step, make_train_step, stack_batches


def check_batch(run: RunConfig, mesh: Mesh) -> None:
    """A ConfigError unless the global batch splits over the data-parallel devices and the
    micro-batches."""
    data_parallel = data_parallel_size(mesh)
    needed = data_parallel * run.train.micro_batches
    if run.train.batch_size % needed:
        raise ConfigError(
            f"global batch {run.train.batch_size} is not divisible by data-parallel size "
            f"{data_parallel} × micro_batches {run.train.micro_batches} = {needed}"
        )


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A compiled train step (`steps_per_execution` steps per execution) and what it costs."""

    setup: Setup
    compiled: Any  # jax.stages.Compiled: (state, batch) → (state, metrics)
    steps_per_execution: int
    compile_time_s: float

    @functools.cached_property
    def analysis(self) -> dict[str, Any]:
        """step_analysis.json: memory per device, FLOPs, collectives (t5scale/analysis/step.py)."""
        return analyze_step(self.compiled, self.setup, self.compile_time_s)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything a train step needs, derived from one RunConfig on one set of devices."""

    run: RunConfig
    mesh: Mesh
    tx: optax.GradientTransformation
    layout: StateLayout
    precision: Precision
    state: TrainState  # jax.ShapeDtypeStruct leaves, each with its at-rest sharding
    canonical: TrainState  # the same for the state's checkpointed form (t5scale/train/state.py)

    def model_state_bytes(self) -> ModelStateBytes:
        """Global bytes of parameters, gradients and optimizer state (with the fp32 master when
        mixed), in the model's shapes: what the ZeRO formula divides."""
        canonical, precision = self.canonical, self.precision
        return model_state_bytes(
            canonical.params, canonical.opt_state, precision.param_dtype, precision.grad_dtype,
            master=precision.mixed,
        )  # fmt: skip

    @property
    def state_shardings(self) -> TrainState:
        return jax.tree.map(lambda leaf: leaf.sharding, self.state)

    def batch_sharding(self, stacked: bool = False) -> NamedSharding:
        return batch_sharding(self.layout, stacked)

    def abstract_batch(self, steps: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
        """The global batch's shapes and sharding (`steps` > 1: that many stacked), to compile
        the step before any data arrive."""
        stack = (steps,) if steps > 1 else ()
        sharding = self.batch_sharding(steps > 1)
        shapes = batch_shapes(self.run.data, self.run.train.batch_size)
        return {
            name: jax.ShapeDtypeStruct(stack + shape, np.int32, sharding=sharding)
            for name, shape in shapes.items()
        }

    def stack(self, batches: list) -> dict[str, jax.Array]:
        """Global batches stacked for a program of len(batches) steps per execution."""
        return stack_batches(batches, self.layout)

    def train_step(self, steps_per_execution: int = 1):
        """The jitted (not yet compiled) step; NaN or Inf as CheckpointConfig.on_nonfinite says."""
        return make_train_step(
            self.run.model, self.layout, self.tx, self.run.train, self.precision,
            skip_nonfinite=self.run.checkpoint.on_nonfinite == "skip",
            steps_per_execution=steps_per_execution,
        )  # fmt: skip

    def compile(self, steps_per_execution: int = 1) -> CompiledStep:
        """The step compiled from abstract shapes in their shardings (nothing allocated).
        step_analysis.json and memory checks use the one-step program: XLA's memory analysis of
        the k-step loop can under-count its temporaries (docs/benchmarks.md)."""
        started = time.perf_counter()
        lowered = self.train_step(steps_per_execution).lower(
            self.state, self.abstract_batch(steps_per_execution)
        )
        compiled = lowered.compile()
        elapsed = time.perf_counter() - started
        return CompiledStep(self, compiled, steps_per_execution, elapsed)

    def eval_step(self):
        return make_eval_step(self.run.model, self.layout, self.run.train.z_loss)

    # The jitted conversions are made once per setup: a fresh jit per call would trace and
    # compile again at every checkpoint.
    @functools.cached_property
    def _initializer(self):
        init = initializer(self.run.model, self.tx, self.layout, self.precision)
        return jax.jit(init, out_shardings=self.state_shardings)

    @functools.cached_property
    def _to_canonical(self):
        convert = functools.partial(to_canonical, tx=self.tx, layout=self.layout,
                                    precision=self.precision)  # fmt: skip
        shardings = jax.tree.map(lambda leaf: leaf.sharding, self.canonical)
        return jax.jit(convert, out_shardings=shardings)

    @functools.cached_property
    def _from_canonical(self):
        convert = functools.partial(from_canonical, tx=self.tx, layout=self.layout,
                                    precision=self.precision)  # fmt: skip
        return jax.jit(convert, out_shardings=self.state_shardings)

    def create_state(self, seed: int | None = None) -> TrainState:
        """Fresh parameters and optimizer state straight in their at-rest shardings (seed:
        TrainConfig.seed unless given); the same values on every stage and mesh."""
        seed = self.run.train.seed if seed is None else seed
        state = self._initializer(jax.random.key(seed))
        # Wait: on XLA's CPU backend two multi-device programs running at once can meet in the
        # same collective rendezvous and abort (seen with the init and the first ZeRO-3 step).
        return jax.block_until_ready(state)

    def compile_state_init(self) -> None:
        """Compile (not run) the state's init, so that a persistent compilation cache holds it."""
        self._initializer.lower(jax.random.key(self.run.train.seed)).compile()

    @property
    def checkpointed_as_is(self) -> bool:
        """Whether the state is its own canonical form (fp32, nothing padded)."""
        return not self.precision.mixed and not self.layout.padded

    @property
    def checkpoint_target(self) -> TrainState:
        """What a checkpoint restores into (shapes, dtypes, shardings)."""
        return self.state if self.checkpointed_as_is else self.canonical

    def to_checkpoint(self, state: TrainState) -> TrainState:
        """The state's canonical form: fp32 parameters (the master, when mixed) and the
        optimizer's own state in the model's shapes."""
        if self.checkpointed_as_is:
            return state
        if not self.layout.padded:  # mixed: the master and the moments as they are
            return TrainState(state.step, state.opt_state.master, state.opt_state.inner)
        return self._to_canonical(state)

    def from_checkpoint(self, canonical: TrainState) -> TrainState:
        """The state from a restored checkpoint_target."""
        if self.checkpointed_as_is:
            return canonical
        return self._from_canonical(canonical)


def build_setup(run: RunConfig, devices: list | None = None) -> Setup:
    """The mesh over `devices` (default: all), the optimizer, the stage's state layout, the
    precision and the abstract state in its shardings; a ConfigError or MeshError in one line
    where the run cannot be laid out on them."""
    mesh = make_mesh(run.parallel, devices)
    check_batch(run, mesh)
    tx = optim.make_optimizer(run.optimizer)
    layout = make_layout(run.parallel, mesh, abstract_params(run.model))
    if layout.padded and run.optimizer.name == "adafactor" and layout.stage.shard_optimizer_state:
        raise ConfigError(
            f"Adafactor's factored statistics would average the padding that zero={layout.zero_size} "
            "needs on this model: choose a zero size that divides its dimensions, or AdamW"
        )
    precision = resolve(run.precision, run.model.dtype)
    shapes = abstract_state(run.model, tx, layout, precision)
    state = with_shardings(shapes, state_shardings(layout, tx, shapes, precision))
    canonical_shapes = jax.eval_shape(canonical_init(run.model, tx), jax.random.key(0))
    canonical = with_shardings(canonical_shapes, canonical_shardings(layout, tx, canonical_shapes))
    return Setup(run, mesh, tx, layout, precision, state, canonical)
