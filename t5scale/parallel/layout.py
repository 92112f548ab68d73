"""Where model state lives: the shardings of parameters, gradients and optimizer state that one
ZeRO stage (t5scale/parallel/zero.py) gives on one mesh.

"At rest" shardings are how the trees are stored between steps; the gradient computation runs in
a shard_map that is manual over the data-parallel axes ("compute" layout), where the stage
decides whether parameters arrive whole or as `zero` shards. At stage 3 the embedding and output
projection are sharded by vocabulary and, while that moves less, used where they lie instead of
gathered (t5scale/parallel/vocab.py).
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
from t5scale.parallel.mesh import MeshError, ParallelConfig
from t5scale.parallel.zero import ZeroStage, get_stage


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one parameter lives: its logical axes, shape and the dimension ZeRO may shard."""

    axes: tuple[str | None, ...]
    shape: tuple[int, ...]
    zero_dim: int | None

    @property
    def over_zero(self) -> bool:
        """Whether a stage that shards this leaf's tree splits it over `zero`."""
        return self.zero_dim is not None

    def spec(self, sharded: bool) -> P:
        """Full (auto-mode) spec: tensor-parallel dims, plus `zero` when this tree is sharded."""
        entries: list = rules.tensor_axes(self.axes)
        if sharded and self.over_zero:
            shared = entries[self.zero_dim]  # `tensor` on a vocabulary: zero-major, tensor-minor
            entries[self.zero_dim] = ("zero", shared) if shared else "zero"
        return P(*entries)

    def manual_spec(self, sharded: bool) -> P:
        """The spec over the data-parallel (manual) axes only, for shard_map's in/out specs."""
        entries: list[str | None] = [None] * len(self.shape)
        if sharded and self.over_zero:
            entries[self.zero_dim] = "zero"
        return P(*entries)

    @property
    def split_by_vocabulary(self) -> bool:
        return self.over_zero and self.axes[self.zero_dim] == "vocab"


def is_leaf_layout(x: Any) -> bool:
    return isinstance(x, LeafLayout)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The layout of parameters, gradients and optimizer state for one stage on one mesh."""

    stage: ZeroStage
    mesh: Mesh
    leaves: Any  # pytree of LeafLayout, shaped like the parameters

    @property
    def zero_size(self) -> int:
        return self.mesh.shape["zero"]

    def map(self, fn) -> Any:
        """fn(LeafLayout) for every parameter, as a tree shaped like the parameters."""
        return jax.tree.map(fn, self.leaves, is_leaf=is_leaf_layout)

    def _named(self, sharded: bool) -> Any:
        return self.map(lambda leaf: NamedSharding(self.mesh, leaf.spec(sharded)))

    @property
    def param_shardings(self) -> Any:
        return self._named(self.stage.shard_parameters)

    @property
    def grad_shardings(self) -> Any:
        return self._named(self.stage.shard_gradients)

    @property
    def update_shardings(self) -> Any:
        """Layout in which the optimizer update runs: that of the optimizer state."""
        return self._named(self.stage.shard_optimizer_state)

    def parameters_per_device(self) -> int:
        """Parameter values one device holds at rest (its largest shard of each leaf)."""
        shardings = self.param_shardings
        counts = jax.tree.map(
            lambda leaf, sharding: math.prod(sharding.shard_shape(leaf.shape)),
            self.leaves, shardings, is_leaf=is_leaf_layout,
        )  # fmt: skip
        return sum(jax.tree.leaves(counts))

    @property
    def vocabulary_parallel(self) -> bool:
        """Stage 3 with the embedding and the output projection split by vocabulary, so that the
        step may use them where they lie (t5scale/parallel/vocab.py decides when it pays)."""
        tables = (self.leaves["embedding"], self.leaves["lm_head"])
        return self.stage.shard_parameters and all(t.split_by_vocabulary for t in tables)

    @property
    def manual_param_specs(self) -> Any:
        return self.map(lambda leaf: leaf.manual_spec(self.stage.shard_parameters))

    @property
    def manual_grad_specs(self) -> Any:
        return self.map(lambda leaf: leaf.manual_spec(self.stage.shard_gradients))

    def opt_state_shardings(self, tx: optax.GradientTransformation, abstract_opt_state: Any) -> Any:
        """Per optimizer-state leaf: the parameter's layout where shapes match, else replicated.

        Adam's moments match their parameters; Adafactor's factored row/column statistics do
        not, and are small, so they stay replicated.
        """
        replicated = NamedSharding(self.mesh, P())
        sharded = self.stage.shard_optimizer_state

        def for_leaf(leaf, layout):
            if tuple(leaf.shape) == layout.shape:
                return NamedSharding(self.mesh, layout.spec(sharded))
            return replicated

        return optax.tree_map_params(
            tx,
            for_leaf,
            abstract_opt_state,
            self.leaves,
            transform_non_params=lambda _: replicated,
            is_leaf=is_leaf_layout,
        )


def make_layout(parallel: ParallelConfig, mesh: Mesh, boxed_abstract_params: Any) -> StateLayout:
    """The state layout of parallel.zero_stage on `mesh`, from abstract, logically annotated
    parameters (flax LogicallyPartitioned boxes)."""
    logical = nn.get_partition_spec(boxed_abstract_params)
    shapes = nn.meta.unbox(boxed_abstract_params)
    zero_size = mesh.shape["zero"]
    tensor_size = mesh.shape["tensor"]

    def leaf_layout(spec: P, shape: jax.ShapeDtypeStruct) -> LeafLayout:
        axes = tuple(spec)
        for name, size in zip(axes, shape.shape, strict=True):
            if name in rules.TENSOR_RULES and size % tensor_size:
                raise MeshError(
                    f"tensor={tensor_size} does not divide the {name!r} dimension ({size}) of the model"
                )
        return LeafLayout(
            axes, tuple(shape.shape), rules.zero_dim(axes, shape.shape, zero_size, tensor_size)
        )

    leaves = jax.tree.map(leaf_layout, logical, shapes, is_leaf=lambda x: isinstance(x, P))
    return StateLayout(get_stage(parallel.zero_stage), mesh, leaves)
