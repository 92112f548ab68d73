"""The train state and its form: how one run keeps its parameters and optimizer state, and the
one form its checkpoints hold. Four choices make the form; `build_form` makes them together:

- the ZeRO stage's layout over `zero`, padding included (t5scale/parallel/layout.py gives each
  leaf its sharding): a tree the stage shards is kept padded;
- precision (t5scale/train/precision.py): in mixed precision the parameters are the bf16
  working copy and the optimizer state holds the fp32 master (`MasterState`);
- replica sync (t5scale/train/replicas.py): under local SGD or DiLoCo every leaf of the
  parameters and optimizer state has one entry per replica on a leading axis, and the state
  holds the outer state (`OuterState`);
- the *canonical* form that checkpoints hold: fp32 parameters (the master, when mixed) and the
  optimizer's own state, in the model's shapes, so that a checkpoint restores into any stage,
  mesh, device count and precision (`StateForm.to_canonical`, `StateForm.from_canonical`), and
  into another synchronisation mode where the replicas agree (`StateForm.restore_target`).

A large state is created straight in its shardings (`StateForm.initializer`), never whole on
one device. A small one (up to ONE_DEVICE_INIT_BYTES, in one process) is created in its
canonical form on one device and then laid out: the random initialisers are the one costly
program to compile in the init (thousands of HLO ops), and made this way they depend on the
model and optimizer alone, so one compile serves every stage, mesh, device count and precision
(and a persistent compilation cache serves them across processes: the study's trials, the
tests). Partitionable threefry makes the values the same either way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from t5scale.analysis.memory import ModelStateBytes, model_state_bytes
from t5scale.errors import ConfigError
from t5scale.model.mt5 import abstract_params, fresh_fp8_state, init_params, layer_stacks
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.layout import LeafLayout, StateLayout, is_leaf_layout, make_layout
from t5scale.parallel.zero import STAGES
from t5scale.train.checkpoint_meta import CheckpointMeta
from t5scale.train.config import RunConfig
from t5scale.train.fp8 import shardings as fp8_shardings
from t5scale.train.precision import FLOAT32, MasterState, Precision, cast, resolve
from t5scale.train.replicas import (
    OuterState,
    ReplicaSyncConfig,
    outer_optimizer,
    per_replica,
    replica_mean,
    split_over_replicas,
)

# The largest canonical state (fp32 parameters and optimizer state) made whole on one device
# before it is laid out; mt5_tiny's is 12 MiB, mt5_small's 3.6 GB.
ONE_DEVICE_INIT_BYTES = 256 * 2**20


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any
    # Local SGD and DiLoCo (t5scale/train/replicas.py): the OuterState, with `params` and
    # `opt_state` then one per replica on a leading axis. None when replicas step together.
    outer: Any = None
    # The FP8 matmuls' scales and amax histories (t5scale/train/fp8.py), replicated and replaced
    # by each step, never by the optimizer; None without FP8.
    fp8: Any = None


# eq=False: a form is compared and hashed by identity (its jitted conversions are cached on it).
@dataclasses.dataclass(frozen=True, eq=False)
class StateForm:
    """How one run keeps its state: the stage's layout, the precision and the replica sync; from
    them the abstract state and its canonical twin (jax.ShapeDtypeStruct leaves, each with its
    sharding; nothing allocated) and the conversions between the two."""

    model: ModelConfig
    tx: optax.GradientTransformation
    layout: StateLayout  # sync_replicas False under local SGD and DiLoCo
    precision: Precision
    sync: ReplicaSyncConfig

    @functools.cached_property
    def outer_tx(self) -> optax.GradientTransformation | None:
        """Local SGD's or DiLoCo's outer optimizer; None: replicas synchronise every step."""
        return outer_optimizer(self.sync) if self.sync.local else None

    @functools.cached_property
    def canonical(self) -> TrainState:
        return _abstract_canonical(self.model, self.tx, self.layout, self.replicas, self.outer_tx)

    @functools.cached_property
    def state(self) -> TrainState:
        """At-rest shapes, converted from the canonical ones (so the model is initialised,
        abstractly, once)."""
        shapes = jax.eval_shape(self._laid_out, _bare(self.canonical))
        shardings = _at_rest_shardings(self.layout, self.tx, shapes, self.precision, self.outer_tx)
        return _with_shardings(shapes, shardings)

    @property
    def shardings(self) -> TrainState:
        return jax.tree.map(lambda leaf: leaf.sharding, self.state)

    @property
    def replicas(self) -> int | None:
        """How many replicas hold a state of their own (local SGD, DiLoCo); None: one state."""
        return self.layout.replicas if self.outer_tx is not None else None

    @property
    def is_canonical(self) -> bool:
        """Whether the state is its own canonical form (fp32, nothing padded, synchronous)."""
        return not self.precision.mixed and not self.layout.padded and self.outer_tx is None

    def model_state_bytes(self) -> ModelStateBytes:
        """Global bytes of parameters, gradients and optimizer state (with the fp32 master when
        mixed), in the model's shapes: what the ZeRO formula divides. With local SGD or DiLoCo,
        one replica's (each holds its own; the outer state is counted apart). With a pipeline,
        one stage's: its share of the layer stacks and everything else (Ψ is then a stage's
        parameters, as Megatron's memory formulas count them)."""
        params, opt_state = self.canonical.params, self.canonical.opt_state
        if self.outer_tx is not None:
            params, opt_state = self.canonical.outer.anchor, _bare(opt_state, 1)
        precision = self.precision
        whole = model_state_bytes(
            params, opt_state, precision.param_dtype, precision.grad_dtype, master=precision.mixed
        )
        stages = self.layout.pipeline_stages
        if stages == 1:
            return whole
        stacked = sum(x.size for x in jax.tree.leaves(layer_stacks(params)))
        count = whole.count - stacked + stacked // stages
        return ModelStateBytes(
            *(round(size * count / whole.count) for size in dataclasses.astuple(whole)[:3]), count
        )

    # The jitted conversions are made once per form: a fresh jit per call would trace and
    # compile again at every checkpoint.
    @functools.cached_property
    def initializer(self):
        """The jitted rng → a fresh state, straight in its at-rest shardings; the same values on
        every stage and mesh."""
        init = _canonical_initializer(self.model, self.tx, self.replicas, self.outer_tx)
        return jax.jit(lambda rng: self._laid_out(init(rng)), out_shardings=self.shardings)

    @functools.cached_property
    def one_device_init(self) -> bool:
        """Whether the state is small enough to be made on one device, then laid out (module
        docstring); one process only, where that device's values can reach every shard."""
        size = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self.canonical))
        return jax.process_count() == 1 and size <= ONE_DEVICE_INIT_BYTES

    @functools.cached_property
    def _canonical_initializer_on_one_device(self):
        init = _canonical_initializer(self.model, self.tx, self.replicas, self.outer_tx)
        device = SingleDeviceSharding(self.layout.mesh.devices.flat[0])
        return jax.jit(init, out_shardings=device)

    def create(self, rng: jax.Array) -> TrainState:
        """A fresh state in its at-rest shardings (module docstring: one device first, or not)."""
        if not self.one_device_init:
            return self.initializer(rng)
        canonical = self._canonical_initializer_on_one_device(rng)
        if self.is_canonical:
            return jax.device_put(canonical, self.shardings)
        canonical = jax.device_put(canonical, jax.tree.map(lambda x: x.sharding, self.canonical))
        return self._from_canonical_jitted(canonical)

    def compile_create(self, rng: jax.Array, compiler_options: dict | None = None) -> None:
        """Compile (not run) what `create` runs, so that a persistent compilation cache holds it."""
        if not self.one_device_init:
            self.initializer.lower(rng).compile(compiler_options=compiler_options)
            return
        self._canonical_initializer_on_one_device.lower(rng).compile(
            compiler_options=compiler_options
        )
        if not self.is_canonical:
            self._from_canonical_jitted.lower(self.canonical).compile(
                compiler_options=compiler_options
            )

    @functools.cached_property
    def _to_canonical_jitted(self):
        shardings = jax.tree.map(lambda leaf: leaf.sharding, self.canonical)
        return jax.jit(self._canonical_of, out_shardings=shardings)

    @functools.cached_property
    def _from_canonical_jitted(self):
        return jax.jit(self._laid_out, out_shardings=self.shardings)

    def to_canonical(self, state: TrainState) -> TrainState:
        if self.is_canonical:
            return state
        if not self.layout.padded and self.outer_tx is None:  # mixed: the master and moments
            master, inner = state.opt_state.master, state.opt_state.inner
            return TrainState(state.step, master, inner, fp8=state.fp8)
        return self._to_canonical_jitted(state)

    def from_canonical(
        self, canonical: TrainState, meta: CheckpointMeta | None = None
    ) -> TrainState:
        """The state from a restored `restore_target(meta)`; `meta`: the checkpoint's, whose
        synchronisation mode may be another."""
        if meta is not None and not self._same_sync(meta):
            canonical = _change_replicas(canonical, self.replicas, self.outer_tx)
            if self.is_canonical:  # laid out as the other mode's checkpoint was
                return jax.device_put(canonical, self.shardings)
        if self.is_canonical:
            return canonical
        return self._from_canonical_jitted(canonical)

    def restore_target(self, meta: CheckpointMeta | None = None) -> TrainState:
        """What a checkpoint restores into (shapes, dtypes, shardings): the state where it is its
        own canonical form, else the canonical form; with the checkpoint's `meta`, the canonical
        form its own synchronisation mode wrote. A ConfigError where it cannot become this
        run's state: replicas that have not synchronised since their last outer step, restored
        into a synchronous run or another replica count."""
        if meta is None or self._same_sync(meta):
            return self.state if self.is_canonical else self.canonical
        replicas = meta.sync.replicas_apart
        if replicas is None:
            return _abstract_canonical(self.model, self.tx, self.layout, None, None)
        if meta.step % meta.sync.period and replicas != self.replicas:
            raise _mid_period_error(meta, self.replicas)
        outer_tx = outer_optimizer(meta.sync.config())
        return _abstract_canonical(self.model, self.tx, self.layout, replicas, outer_tx)

    def _same_sync(self, meta: CheckpointMeta) -> bool:
        """Whether a checkpoint is laid out as this run's: the same mode (the outer momentum)
        and the same replicas."""
        return (meta.sync.mode, meta.sync.replicas_apart) == (self.sync.mode, self.replicas)

    def _laid_out(self, canonical: TrainState) -> TrainState:
        """The state as the stage, precision and replica sync keep it (not jitted)."""
        if canonical.outer is None:
            return self._one_laid_out(canonical)
        return self._for_each_replica(self._one_laid_out, LeafLayout.pad, canonical)

    def _canonical_of(self, state: TrainState) -> TrainState:
        if state.outer is None:
            return self._one_canonical_of(state)
        return self._for_each_replica(self._one_canonical_of, LeafLayout.unpad, state)

    def _one_laid_out(self, canonical: TrainState) -> TrainState:
        """One (synchronous, or one replica's) state from its canonical form."""
        layout, precision = self.layout, self.precision
        shard_opt_state = layout.stage.shard_optimizer_state
        params, opt_state = canonical.params, canonical.opt_state
        if shard_opt_state:
            opt_state = _map_opt_params(self.tx, lambda x, leaf: leaf.pad(x), opt_state, layout)
        if precision.mixed:
            master = layout.pad(params) if shard_opt_state else params
            opt_state = MasterState(master, opt_state)
            params = cast(params, precision.param_dtype)
        if layout.stage.shard_parameters:
            params = layout.pad(params)
        return TrainState(canonical.step, params, opt_state, fp8=canonical.fp8)

    def _one_canonical_of(self, state: TrainState) -> TrainState:
        params, opt_state = state.params, state.opt_state
        if self.precision.mixed:
            params, opt_state = opt_state.master, opt_state.inner
        layout = self.layout
        opt_state = _map_opt_params(self.tx, lambda x, leaf: leaf.unpad(x), opt_state, layout)
        return TrainState(state.step, layout.unpad(params), opt_state, fp8=state.fp8)

    def _for_each_replica(self, convert, resize, state: TrainState) -> TrainState:
        """`convert` of local SGD's or DiLoCo's state: each replica's parameters and optimizer
        state, and the outer state resized (LeafLayout.pad or unpad) as optimizer state."""

        def one_replica(params, opt_state):
            converted = convert(TrainState(state.step, params, opt_state))
            return converted.params, converted.opt_state

        params, opt_state = jax.vmap(one_replica)(state.params, state.opt_state)
        outer, layout = state.outer, self.layout
        if layout.stage.shard_optimizer_state:
            outer = OuterState(
                jax.tree.map(resize, layout.leaves, outer.anchor, is_leaf=is_leaf_layout),
                _map_opt_params(self.outer_tx, lambda x, leaf: resize(leaf, x),
                                outer.momentum, layout),
            )  # fmt: skip
        return TrainState(state.step, params, opt_state, outer)


def build_form(run: RunConfig, mesh: Mesh, tx: optax.GradientTransformation) -> StateForm:
    """A ConfigError or MeshError in one line where `run`'s state cannot be laid out on `mesh`."""
    layout = make_layout(run.parallel, mesh, abstract_params(run.model))
    layout = dataclasses.replace(layout, sync_replicas=not run.sync.local)
    if layout.padded and run.optimizer.name == "adafactor" and layout.stage.shard_optimizer_state:
        raise ConfigError(
            f"Adafactor's factored statistics would average the padding that zero={layout.zero_size} "
            "needs on this model: choose a zero size that divides its dimensions, or AdamW"
        )
    form = StateForm(run.model, tx, layout, resolve(run.precision, run.model.dtype), run.sync)
    # The abstract state and canonical form now, in one pass, not inside a compile's timing.
    _ = form.state
    return form


def _canonical_initializer(
    model: ModelConfig,
    tx: optax.GradientTransformation,
    replicas: int | None = None,
    outer_tx: optax.GradientTransformation | None = None,
):
    """rng → the canonical state: fp32 parameters in the model's shapes and fresh optimizer
    state; with `replicas`, local SGD's or DiLoCo's (one copy per replica, the outer state).
    The random values do not depend on the mesh (partitionable threefry)."""

    def init(rng: jax.Array) -> TrainState:
        return _canonical_around(model, tx, replicas, outer_tx, init_params(model, rng))

    return init


def _canonical_around(
    model: ModelConfig,
    tx: optax.GradientTransformation,
    replicas: int | None,
    outer_tx: optax.GradientTransformation | None,
    params: Any,
) -> TrainState:
    """The canonical state around these parameters: fresh optimizer and FP8 state."""
    fp8 = fresh_fp8_state(model, jnp.full)
    state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), fp8=fp8)
    return state if replicas is None else _local_canonical(state, replicas, outer_tx)


def _abstract_canonical(
    model: ModelConfig,
    tx: optax.GradientTransformation,
    layout: StateLayout,
    replicas: int | None,
    outer_tx: optax.GradientTransformation | None,
) -> TrainState:
    """Everything split over `zero` where the model's shapes allow, as stage 3 would, so that little
    is whole on one device while a checkpoint restores."""
    # From the abstract parameters (cached per model), not by tracing the model's init again.
    params = nn.meta.unbox(abstract_params(model))
    shapes = jax.eval_shape(
        functools.partial(_canonical_around, model, tx, replicas, outer_tx), params
    )
    everything_sharded = dataclasses.replace(layout.unpadded(), stage=STAGES[3])
    shardings = _at_rest_shardings(everything_sharded, tx, shapes, FLOAT32, outer_tx)
    return _with_shardings(shapes, shardings)


def _at_rest_shardings(
    layout: StateLayout,
    tx: optax.GradientTransformation,
    shapes: TrainState,
    precision: Precision,
    outer_tx: optax.GradientTransformation | None = None,
) -> TrainState:
    """The at-rest sharding of every leaf of a state shaped like `shapes`. Local SGD's and
    DiLoCo's per-replica trees are split over `replica` when they hold one entry per replica of
    the mesh (else, a checkpoint of another replica count, whole on every device)."""
    if shapes.outer is not None:
        replicas = jax.tree.leaves(shapes.params)[0].shape[0]
        one = TrainState(shapes.step, _bare(shapes.params, 1), _bare(shapes.opt_state, 1))
        inner = _at_rest_shardings(layout, tx, one, precision)
        over = "replica" if replicas == layout.replicas else None
        outer = OuterState(
            layout.update_shardings, layout.opt_state_shardings(outer_tx, shapes.outer.momentum)
        )
        return TrainState(
            inner.step, split_over_replicas(inner.params, over),
            split_over_replicas(inner.opt_state, over), outer,
        )  # fmt: skip
    opt_state = shapes.opt_state
    if precision.mixed:
        opt_state = MasterState(
            layout.update_shardings, layout.opt_state_shardings(tx, opt_state.inner)
        )
    else:
        opt_state = layout.opt_state_shardings(tx, opt_state)
    return TrainState(
        step=NamedSharding(layout.mesh, PartitionSpec()),
        params=layout.param_shardings,
        opt_state=opt_state,
        fp8=fp8_shardings(layout.mesh, shapes.fp8),
    )


def _map_opt_params(tx, fn, opt_state: Any, layout: StateLayout) -> Any:
    """fn(leaf, LeafLayout) on every parameter-shaped tree inside an optimizer state."""
    return optax.tree_map_params(
        tx, fn, opt_state, layout.leaves, transform_non_params=lambda x: x, is_leaf=is_leaf_layout
    )


def _bare(shapes: Any, leading: int = 0) -> Any:
    """Shapes and dtypes alone, without their first `leading` dimensions (1: one replica's)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[leading:], x.dtype), shapes)


def _with_shardings(shapes: Any, shardings: Any) -> Any:
    """Shapes, dtypes and shardings without arrays: what a step compiles for and a checkpoint
    restores into."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


# ---- checkpoints of another synchronisation mode ---------------------------------------------


def _mid_period_error(meta: CheckpointMeta, replicas: int | None) -> ConfigError:
    mode, saved_replicas, every = meta.sync.mode, meta.sync.replicas_apart, meta.sync.period
    step = meta.step
    into = "a synchronous run" if replicas is None else f"{replicas} replicas"
    return ConfigError(
        f"the checkpoint at step {step} is {step % every} steps into a {mode} period (H={every}) "
        f"of {saved_replicas} replicas, which differ until they synchronise: it resumes into "
        f"{saved_replicas} replicas only, not {into} (or resume from a checkpoint at a multiple "
        "of H)"
    )


def _local_canonical(state: TrainState, replicas: int, outer_tx) -> TrainState:
    """Local SGD's or DiLoCo's canonical state from a synchronous one: every replica starts
    from its parameters and optimizer state, the anchor is its parameters, no outer momentum."""
    outer = OuterState(state.params, outer_tx.init(state.params))
    return TrainState(
        state.step, per_replica(state.params, replicas), per_replica(state.opt_state, replicas),
        outer,
    )  # fmt: skip


def _synchronised_canonical(state: TrainState) -> TrainState:
    """A synchronous canonical state from local SGD's or DiLoCo's at a synchronisation: the
    anchor's parameters and the replicas' inner optimizer states averaged."""
    return TrainState(state.step, state.outer.anchor, replica_mean(state.opt_state))


def _change_replicas(
    state: TrainState, replicas: int | None, outer_tx: optax.GradientTransformation | None
) -> TrainState:
    """A canonical state for another synchronisation: `replicas` None for every step, else that
    many replicas with `outer_tx` (a checkpoint's form into a run's). The same replica count
    keeps each replica's state; otherwise the state must be at a synchronisation (the caller
    checks). The outer momentum is kept where both forms have one of the same structure."""
    if replicas is None:
        return _synchronised_canonical(state) if state.outer is not None else state
    if state.outer is None:
        return _local_canonical(state, replicas, outer_tx)
    if jax.tree.leaves(state.params)[0].shape[0] != replicas:
        momentum = state.outer.momentum
        state = _local_canonical(_synchronised_canonical(state), replicas, outer_tx)
        state = state.replace(outer=state.outer.replace(momentum=momentum))
    fresh = outer_tx.init(state.outer.anchor)
    if jax.tree.structure(fresh) != jax.tree.structure(state.outer.momentum):
        state = state.replace(outer=state.outer.replace(momentum=fresh))
    return state
