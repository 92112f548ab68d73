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
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from t5scale.analysis.memory import (
    ModelStateBytes,
    compiled_memory,
    device_memory_budget,
    model_state_bytes,
)
from t5scale.analysis.step import analyze_step
from t5scale.data.synthetic import batch_shapes
from t5scale.errors import ConfigError
from t5scale.model.mt5 import abstract_params
from t5scale.model.sizes import REMAT_LADDER
from t5scale.parallel.layout import StateLayout, make_layout
from t5scale.parallel.mesh import data_parallel_size, make_mesh
from t5scale.train import optim
from t5scale.train.config import RunConfig
from t5scale.train.precision import Precision, resolve
from t5scale.train.replicas import ReplicaSyncConfig, outer_optimizer
from t5scale.train.state import (
    TrainState,
    abstract_state,
    canonical_init,
    canonical_initializer,
    canonical_shardings,
    change_replicas,
    from_canonical,
    initializer,
    local_canonical,
    state_shardings,
    to_canonical,
    with_shardings,
)
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
    data_parallel = data_parallel_size(mesh)
    needed = data_parallel * run.train.micro_batches
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
    remat: dict[str, Any] | None = None

    @functools.cached_property
    def analysis(self) -> dict[str, Any]:
        """step_analysis.json: memory per device, FLOPs, collectives (t5scale/analysis/step.py)."""
        outer = self.setup.compiled_outer.compiled if self.setup.outer_tx is not None else None
        analysis = analyze_step(self.compiled, self.setup, self.compile_time_s, outer)
        policy = self.setup.run.model.remat
        return analysis | {"remat": self.remat or {"requested": policy, "policy": policy}}


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
    # Local SGD's or DiLoCo's outer optimizer (t5scale/train/replicas.py); None: replicas
    # synchronise every step.
    outer_tx: optax.GradientTransformation | None = None

    def model_state_bytes(self) -> ModelStateBytes:
        """Global bytes of parameters, gradients and optimizer state (with the fp32 master when
        mixed), in the model's shapes: what the ZeRO formula divides. With local SGD or DiLoCo,
        one replica's (each holds its own; the outer state is counted apart)."""
        canonical, precision = self.canonical, self.precision
        params, opt_state = canonical.params, canonical.opt_state
        if self.outer_tx is not None:
            params = canonical.outer.anchor
            opt_state = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), opt_state
            )
        return model_state_bytes(
            params, opt_state, precision.param_dtype, precision.grad_dtype, master=precision.mixed
        )

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
        """The jitted (not yet compiled) step; NaN or Inf as CheckpointConfig.on_nonfinite says.
        With remat 'auto', that of the policy `compile` chooses (CompiledStep.setup)."""
        if self.run.model.remat == "auto":
            raise ConfigError("remat 'auto' is chosen by Setup.compile: use its step's setup")
        return make_train_step(
            self.run.model, self.layout, self.tx, self.run.train, self.state_shardings,
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
        compiled = lowered.compile()
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
            peak = compiled_memory(step.compiled)["peak_estimate_bytes"]
            tried.append({"policy": policy, "peak_estimate_bytes": peak})
            if peak <= budget or index == len(REMAT_LADDER) - 1:
                break
        agreed = _most_frugal(index)
        if agreed != index:
            step = self.with_remat(REMAT_LADDER[agreed]).compile()
            peak = compiled_memory(step.compiled)["peak_estimate_bytes"]
        choice = {"requested": "auto", "policy": REMAT_LADDER[agreed], "budget_bytes": budget,
                  "fits": peak <= budget, "tried": tried}  # fmt: skip
        return dataclasses.replace(step, remat=choice)

    @functools.cached_property
    def outer_step(self):
        """The jitted outer step of local SGD or DiLoCo (t5scale/train/replicas.py)."""
        return make_outer_step(
            self.layout, self.precision, self.run.sync, self.outer_tx, self.state_shardings
        )

    @functools.cached_property
    def compiled_outer(self) -> CompiledStep:
        """The outer step compiled from abstract shapes (local SGD, DiLoCo)."""
        started = time.perf_counter()
        compiled = self.outer_step.lower(self.state).compile()
        return CompiledStep(self, compiled, 1, time.perf_counter() - started)

    @functools.cached_property
    def _anchor_params(self):
        convert = functools.partial(working_copy, self.layout, self.precision)
        return jax.jit(convert, out_shardings=self.layout.param_shardings)

    def model_params(self, state: TrainState) -> Any:
        """The parameters to evaluate, in the stage's layout: the state's own, or with local SGD
        and DiLoCo the synchronised ones (the anchor, as of the last outer step)."""
        if self.outer_tx is None:
            return state.params
        return self._anchor_params(state.outer.anchor)

    def eval_step(self):
        return make_eval_step(self.run.model, self.layout, self.run.train.z_loss)

    # The jitted conversions are made once per setup: a fresh jit per call would trace and
    # compile again at every checkpoint.
    @functools.cached_property
    def _initializer(self):
        init = initializer(self.run.model, self.tx, self.layout, self.precision, self.outer_tx)
        return jax.jit(init, out_shardings=self.state_shardings)

    @functools.cached_property
    def _to_canonical(self):
        convert = functools.partial(to_canonical, tx=self.tx, layout=self.layout,
                                    precision=self.precision, outer_tx=self.outer_tx)  # fmt: skip
        shardings = jax.tree.map(lambda leaf: leaf.sharding, self.canonical)
        return jax.jit(convert, out_shardings=shardings)

    @functools.cached_property
    def _from_canonical(self):
        convert = functools.partial(from_canonical, tx=self.tx, layout=self.layout,
                                    precision=self.precision, outer_tx=self.outer_tx)  # fmt: skip
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
        return not self.precision.mixed and not self.layout.padded and self.outer_tx is None

    @property
    def checkpoint_target(self) -> TrainState:
        """What a checkpoint restores into (shapes, dtypes, shardings)."""
        return self.state if self.checkpointed_as_is else self.canonical

    def to_checkpoint(self, state: TrainState) -> TrainState:
        """The state's canonical form: fp32 parameters (the master, when mixed) and the
        optimizer's own state in the model's shapes."""
        if self.checkpointed_as_is:
            return state
        if not self.layout.padded and self.outer_tx is None:  # mixed: the master and moments
            return TrainState(state.step, state.opt_state.master, state.opt_state.inner)
        return self._to_canonical(state)

    def from_checkpoint(self, canonical: TrainState, meta: dict | None = None) -> TrainState:
        """The state from a restored checkpoint_target (or `saved_target(meta)`)."""
        if meta is not None and _form(_saved_sync(meta)) != _form(self._sync_form):
            canonical = change_replicas(canonical, self._sync_form["replicas"], self.outer_tx)
            if self.checkpointed_as_is:  # laid out as the other mode's checkpoint was
                return jax.device_put(canonical, self.state_shardings)
        if self.checkpointed_as_is:
            return canonical
        return self._from_canonical(canonical)

    @property
    def _sync_form(self) -> dict:
        """How this run's checkpoints are laid out: the mode and the replica count."""
        replicas = self.mesh.shape["replica"] if self.outer_tx is not None else None
        return {"mode": self.run.sync.mode, "replicas": replicas}

    def saved_target(self, meta: dict) -> TrainState:
        """What a checkpoint with this meta restores into: checkpoint_target, or the canonical
        form its own synchronisation mode wrote. A ConfigError where it cannot become this run's
        state: replicas that have not synchronised since their last outer step, restored into
        a synchronous run or another replica count."""
        saved = _saved_sync(meta)
        if _form(saved) == _form(self._sync_form):
            return self.checkpoint_target
        if saved["replicas"] is not None:
            step, every = meta["step"], saved["every"]
            if step % every and saved["replicas"] != self._sync_form["replicas"]:
                into = self._sync_form["replicas"]
                into = "a synchronous run" if into is None else f"{into} replicas"
                raise ConfigError(
                    f"the checkpoint at step {step} is {step % every} steps into a "
                    f"{saved['mode']} period (H={every}) of {saved['replicas']} replicas, which "
                    f"differ until they synchronise: it resumes into {saved['replicas']} "
                    f"replicas only, not {into} (or resume from a checkpoint at a multiple of H)"
                )
            outer_tx = outer_optimizer(ReplicaSyncConfig(**_outer_settings(meta)))
            layout = dataclasses.replace(self.layout, sync_replicas=False)
            shapes = jax.eval_shape(
                lambda rng: local_canonical(
                    canonical_init(self.run.model, self.tx)(rng), saved["replicas"], outer_tx
                ),
                jax.random.key(0),
            )
            return with_shardings(shapes, canonical_shardings(layout, self.tx, shapes, outer_tx))
        shapes = jax.eval_shape(canonical_init(self.run.model, self.tx), jax.random.key(0))
        return with_shardings(shapes, canonical_shardings(self.layout, self.tx, shapes))


def _most_frugal(index: int) -> int:
    """The largest of the processes' remat choices (an index into REMAT_LADDER): they must
    compile the same program."""
    if jax.process_count() == 1:
        return index
    return int(np.max(multihost_utils.process_allgather(np.int32(index))))


def _saved_sync(meta: dict | None) -> dict:
    """A checkpoint's synchronisation mode and replica count (None: every step)."""
    sync = (meta or {}).get("sync", {"mode": "every_step"})
    replicas = sync.get("replicas") if sync["mode"] != "every_step" else None
    return {"mode": sync["mode"], "replicas": replicas, "every": sync.get("every", 1)}


def _form(sync: dict) -> tuple:
    """What decides a checkpoint's layout: the mode (the outer momentum) and the replicas."""
    return sync["mode"], sync["replicas"]


def _outer_settings(meta: dict) -> dict:
    sync = meta["sync"]
    return {"mode": sync["mode"], "every": sync["every"],
            "outer_learning_rate": sync["outer_learning_rate"],
            "outer_momentum": sync["outer_momentum"]}  # fmt: skip


def build_setup(run: RunConfig, devices: list | None = None) -> Setup:
    """The mesh over `devices` (default: all), the optimizer, the stage's state layout, the
    precision and the abstract state in its shardings; a ConfigError or MeshError in one line
    where the run cannot be laid out on them."""
    mesh = make_mesh(run.parallel, devices)
    check_batch(run, mesh)
    tx = optim.make_optimizer(run.optimizer)
    layout = make_layout(run.parallel, mesh, abstract_params(run.model))
    outer_tx = outer_optimizer(run.sync) if run.sync.local else None
    layout = dataclasses.replace(layout, sync_replicas=outer_tx is None)
    if layout.padded and run.optimizer.name == "adafactor" and layout.stage.shard_optimizer_state:
        raise ConfigError(
            f"Adafactor's factored statistics would average the padding that zero={layout.zero_size} "
            "needs on this model: choose a zero size that divides its dimensions, or AdamW"
        )
    precision = resolve(run.precision, run.model.dtype)
    shapes = abstract_state(run.model, tx, layout, precision, outer_tx)
    state = with_shardings(shapes, state_shardings(layout, tx, shapes, precision, outer_tx))
    init = canonical_initializer(run.model, tx, layout, outer_tx)
    canonical_shapes = jax.eval_shape(init, jax.random.key(0))
    canonical = with_shardings(
        canonical_shapes, canonical_shardings(layout, tx, canonical_shapes, outer_tx)
    )
    return Setup(run, mesh, tx, layout, precision, state, canonical, outer_tx)
