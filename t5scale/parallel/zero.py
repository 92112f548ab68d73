"""ZeRO stages as data, and the shardings of model state that follow from them.

A stage says which of the three trees — parameters, gradients (with the accumulation buffer) and
optimizer state — are sharded over the mesh's `zero` axis. Every sharding in t5scale is derived from
this one table:

| stage | parameters | gradients / accumulator | optimizer state | gradient collective | parameter collective             |
|-------|------------|-------------------------|-----------------|---------------------|----------------------------------|
| 0     | replicated | replicated              | replicated      | all-reduce          | none                             |
| 1     | replicated | replicated              | sharded         | all-reduce          | all-gather after the update      |
| 2     | replicated | sharded                 | sharded         | reduce-scatter      | all-gather after the update      |
| 3     | sharded    | sharded                 | sharded         | reduce-scatter      | all-gather before each use       |

At stage 3 the embedding and output projection are sharded by vocabulary and, while that moves
less, used where they lie instead of gathered (t5scale/parallel/vocab.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5scale.parallel import rules
from t5scale.parallel.mesh import MeshError


@dataclasses.dataclass(frozen=True)
class ZeroStage:
    stage: int
    shard_optimizer_state: bool
    shard_gradients: bool
    shard_parameters: bool
    gradient_collective: str
    parameter_collective: str


STAGES: tuple[ZeroStage, ...] = (
    ZeroStage(0, False, False, False, "all-reduce", "none"),
    ZeroStage(1, True, False, False, "all-reduce", "all-gather after the update"),
    ZeroStage(2, True, True, False, "reduce-scatter", "all-gather after the update"),
    ZeroStage(3, True, True, True, "reduce-scatter", "all-gather before each use"),
)


def get_stage(stage: int) -> ZeroStage:
    if stage not in range(len(STAGES)):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    return STAGES[stage]


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one parameter lives: its logical axes, shape and the dimension ZeRO may shard."""

    axes: tuple[str | None, ...]
    shape: tuple[int, ...]
    zero_dim: int | None

    def spec(self, over_zero: bool) -> P:
        """Full (auto-mode) spec: tensor-parallel dims, plus `zero` when this tree is sharded."""
        entries: list = rules.tensor_axes(self.axes)
        if over_zero and self.zero_dim is not None:
            shared = entries[self.zero_dim]  # `tensor` on a vocabulary: zero-major, tensor-minor
            entries[self.zero_dim] = ("zero", shared) if shared else "zero"
        return P(*entries)

    def manual_spec(self, over_zero: bool) -> P:
        """The spec over the data-parallel (manual) axes only, for shard_map's in/out specs."""
        entries: list[str | None] = [None] * len(self.shape)
        if over_zero and self.zero_dim is not None:
            entries[self.zero_dim] = "zero"
        return P(*entries)

    @property
    def sharded_by_zero(self) -> bool:
        return self.zero_dim is not None

    @property
    def split_by_vocabulary(self) -> bool:
        return self.zero_dim is not None and self.axes[self.zero_dim] == "vocab"


def _is_layout(x: Any) -> bool:
    return isinstance(x, LeafLayout)


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """The layout of parameters, gradients and optimizer state for one stage on one mesh.

    "At rest" shardings are how the trees are stored between steps; the gradient computation runs
    in a shard_map that is manual over the data-parallel axes ("compute" layout), where the stage
    decides whether parameters arrive whole or as `zero` shards.
    """

    stage: ZeroStage
    mesh: Mesh
    layouts: Any  # pytree of LeafLayout, shaped like the parameters

    def _map(self, fn) -> Any:
        return jax.tree.map(fn, self.layouts, is_leaf=_is_layout)

    def _named(self, over_zero: bool) -> Any:
        return self._map(lambda leaf: NamedSharding(self.mesh, leaf.spec(over_zero)))

    @property
    def param_shardings(self) -> Any:
        return self._named(self.stage.shard_parameters)

    def parameters_per_device(self) -> int:
        """Parameter values one device holds at rest (its largest shard of each leaf)."""
        counts = self._map(
            lambda leaf: math.prod(
                NamedSharding(self.mesh, leaf.spec(self.stage.shard_parameters)).shard_shape(
                    leaf.shape
                )
            )
        )
        return sum(jax.tree.leaves(counts))

    @property
    def grad_shardings(self) -> Any:
        return self._named(self.stage.shard_gradients)

    @property
    def update_shardings(self) -> Any:
        """Layout in which the optimizer update runs: that of the optimizer state."""
        return self._named(self.stage.shard_optimizer_state)

    @property
    def vocabulary_parallel(self) -> bool:
        """Stage 3 with the embedding and the output projection split by vocabulary, so that the
        step may use them where they lie (t5scale/parallel/vocab.py decides when it pays)."""
        tables = (self.layouts["embedding"], self.layouts["lm_head"])
        return self.stage.shard_parameters and all(t.split_by_vocabulary for t in tables)

    @property
    def manual_param_specs(self) -> Any:
        return self._map(lambda leaf: leaf.manual_spec(self.stage.shard_parameters))

    @property
    def manual_grad_specs(self) -> Any:
        return self._map(lambda leaf: leaf.manual_spec(self.stage.shard_gradients))

    def opt_state_shardings(self, tx: optax.GradientTransformation, abstract_opt_state: Any) -> Any:
        """Per optimizer-state leaf: the parameter's layout where shapes match, else replicated.

        Adam's moments match their parameters; Adafactor's factored row/column statistics do
        not, and are small, so they stay replicated.
        """
        replicated = NamedSharding(self.mesh, P())
        over_zero = self.stage.shard_optimizer_state

        def for_leaf(leaf, layout):
            if tuple(leaf.shape) == layout.shape:
                return NamedSharding(self.mesh, layout.spec(over_zero))
            return replicated

        return optax.tree_map_params(
            tx,
            for_leaf,
            abstract_opt_state,
            self.layouts,
            transform_non_params=lambda _: replicated,
            is_leaf=_is_layout,
        )


def make_plan(stage: int, mesh: Mesh, boxed_abstract_params: Any) -> StatePlan:
    """Plan the shardings of a model's state from its abstract, logically annotated parameters."""
    logical = nn.get_partition_spec(boxed_abstract_params)
    shapes = nn.meta.unbox(boxed_abstract_params)
    zero_size = mesh.shape["zero"]
    tensor_size = mesh.shape["tensor"]

    def layout(spec: P, shape: jax.ShapeDtypeStruct) -> LeafLayout:
        axes = tuple(spec)
        for name, size in zip(axes, shape.shape, strict=True):
            if name in rules.TENSOR_RULES and size % tensor_size:
                raise MeshError(
                    f"tensor={tensor_size} does not divide the {name!r} dimension ({size}) of the model"
                )
        return LeafLayout(
            axes, tuple(shape.shape), rules.zero_dim(axes, shape.shape, zero_size, tensor_size)
        )

    layouts = jax.tree.map(layout, logical, shapes, is_leaf=lambda x: isinstance(x, P))
    return StatePlan(get_stage(stage), mesh, layouts)
