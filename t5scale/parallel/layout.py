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
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5scale.errors import MeshError
from t5scale.model.mt5 import EMBEDDING, LM_HEAD
from t5scale.parallel import rules
from t5scale.parallel.mesh import DATA_AXES, ParallelConfig
from t5scale.parallel.zero import ZeroStage, get_stage
from t5scale.target import Target


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one parameter lives: its logical axes, shape, the dimension ZeRO shards and that
    dimension's padded size.

    A tree that the stage shards over `zero` is kept in the padded shape (the sharded dimension
    rounded up to a multiple of the zero size), so every stage shards every leaf on any device
    count, as DeepSpeed's flat buffers are padded to the shard count. The padding is zeros; it
    never reaches the model's arithmetic, the loss or a checkpoint (`pad`, `unpad`).
    """

    axes: tuple[str | None, ...]
    shape: tuple[int, ...]
    zero_dim: int | None
    padded: tuple[int, ...]  # the shape with zero_dim padded; `shape` where nothing is padded
    # The stacked `layers` dimension where a pipeline splits it into stages, else None.
    pipeline_dim: int | None = None

    @property
    def is_padded(self) -> bool:
        return self.padded != self.shape

    def at_rest(self, sharded: bool) -> tuple[int, ...]:
        """The shape of this leaf in a tree that is (or is not) sharded over `zero`."""
        return self.padded if sharded else self.shape

    def pad(self, x: jax.Array) -> jax.Array:
        """x in the padded shape, if x has the model's (else x as it is: padded already, or an
        optimizer statistic of another shape)."""
        if not self.is_padded or tuple(x.shape) != self.shape:
            return x
        return jnp.pad(x, [(0, p - s) for p, s in zip(self.padded, self.shape, strict=True)])

    def unpad(self, x: jax.Array, leading: int = 0) -> jax.Array:
        """x in the model's shape; `leading`: dimensions x lacks in front (a scanned layer's
        parameter inside the scan has lost its `layers` axis)."""
        if not self.is_padded or tuple(x.shape) != self.padded[leading:]:
            return x
        dim = self.zero_dim - leading
        return lax.slice_in_dim(x, 0, self.shape[self.zero_dim], axis=dim)

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
        if self.pipelined:
            entries[self.pipeline_dim] = "pipeline"
        return P(*entries)

    def manual_spec(self, sharded: bool) -> P:
        """The spec over the manual axes only (data-parallel, and `pipeline`), for shard_map's
        in/out specs."""
        entries: list[str | None] = [None] * len(self.shape)
        if sharded and self.over_zero:
            entries[self.zero_dim] = "zero"
        if self.pipelined:
            entries[self.pipeline_dim] = "pipeline"
        return P(*entries)

    @property
    def pipelined(self) -> bool:
        """Whether this leaf is a layer stack split over the pipeline's stages."""
        return self.pipeline_dim is not None

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
    # False: replicas step on their own (local SGD, DiLoCo: t5scale/train/replicas.py) and the
    # train step reduces over `zero` only; these trees are then one replica's.
    sync_replicas: bool = True

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes a train step reduces gradients and losses over."""
        return DATA_AXES if self.sync_replicas else ("zero",)

    @property
    def zero_size(self) -> int:
        return self.mesh.shape["zero"]

    @property
    def replicas(self) -> int:
        """The size of the mesh's `replica` axis (hosts, slices or DiLoCo replicas)."""
        return self.mesh.shape["replica"]

    @property
    def pipeline_stages(self) -> int:
        """The size of the mesh's `pipeline` axis (1: no pipeline)."""
        return self.mesh.shape["pipeline"]

    @functools.cached_property
    def spans_slow_network(self) -> bool:
        """Whether the mesh's devices are in several groups only the slow network joins (hosts,
        TPU slices: Target.dcn_groups)."""
        return Target.of(list(self.mesh.devices.flat)).dcn_groups > 1

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The axes the gradient's shard_map is manual over (t5scale/train/gradients.py)."""
        return (*DATA_AXES, "pipeline") if self.pipeline_stages > 1 else DATA_AXES

    def map(self, fn) -> Any:
        """fn(LeafLayout) for every parameter, as a tree shaped like the parameters."""
        return jax.tree.map(fn, self.leaves, is_leaf=is_leaf_layout)

    @property
    def padded(self) -> bool:
        """Whether any leaf is padded on this mesh."""
        return any(leaf.is_padded for leaf in jax.tree.leaves(self.leaves, is_leaf=is_leaf_layout))

    def unpadded(self) -> StateLayout:
        """This layout for trees kept in the model's shapes (a checkpoint): a padded leaf is
        split over `zero` on another dimension that divides (the scanned `layers` axis too:
        nothing computes on this layout), or kept whole."""
        zero_size = self.zero_size

        def in_model_shape(leaf: LeafLayout) -> LeafLayout:
            if not leaf.is_padded:
                return leaf
            dims = [
                dim
                for dim, name in enumerate(leaf.axes)
                if name not in rules.TENSOR_RULES and leaf.shape[dim] % zero_size == 0
            ]
            dim = max(dims, key=lambda d: leaf.shape[d]) if dims else None
            return dataclasses.replace(leaf, zero_dim=dim, padded=leaf.shape)

        return dataclasses.replace(self, leaves=self.map(in_model_shape))

    def pad(self, tree: Any) -> Any:
        """A parameter-shaped tree in the padded shapes (of a tree the stage shards)."""
        return jax.tree.map(lambda leaf, x: leaf.pad(x), self.leaves, tree, is_leaf=is_leaf_layout)

    def unpad(self, tree: Any) -> Any:
        """A parameter-shaped tree in the model's shapes."""
        return jax.tree.map(
            lambda leaf, x: leaf.unpad(x), self.leaves, tree, is_leaf=is_leaf_layout
        )

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
        """Parameter values one device holds at rest (its shard of each leaf, padding
        included)."""
        sharded = self.stage.shard_parameters
        counts = jax.tree.map(
            lambda leaf, sharding: math.prod(sharding.shard_shape(leaf.at_rest(sharded))),
            self.leaves, self.param_shardings, is_leaf=is_leaf_layout,
        )  # fmt: skip
        return sum(jax.tree.leaves(counts))

    @property
    def vocabulary_parallel(self) -> bool:
        """Stage 3 with the embedding and the output projection split by vocabulary, so that the
        step may use them where they lie (t5scale/parallel/vocab.py decides when it pays)."""
        tables = (self.leaves[EMBEDDING], self.leaves[LM_HEAD])
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
            if tuple(leaf.shape) == layout.at_rest(sharded):
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
    stages = mesh.shape["pipeline"]

    def leaf_layout(path, spec: P, leaf: jax.ShapeDtypeStruct) -> LeafLayout:
        axes, shape = tuple(spec), tuple(leaf.shape)
        for name, size in zip(axes, shape, strict=True):
            if name in rules.TENSOR_RULES and size % tensor_size:
                raise MeshError(
                    f"tensor={tensor_size} does not divide the {name!r} dimension ({size}) of the model"
                )
        pipeline_dim = axes.index("layers") if stages > 1 and "layers" in axes else None
        if pipeline_dim is not None and shape[pipeline_dim] % stages:
            stack = jax.tree_util.keystr(path[:1])
            raise MeshError(
                f"pipeline={stages} does not divide the {shape[pipeline_dim]} layers of the "
                f"{stack} stack: every stage must hold as many layers"
            )
        dim = rules.zero_dim(axes, shape, zero_size, tensor_size)
        if dim is None and zero_size > 1:
            raise MeshError(
                f"parameter {jax.tree_util.keystr(path)} {shape} (axes {axes}) has no dimension "
                f"that zero={zero_size} may split: it would stay whole on every device"
            )
        padded = list(shape)
        if dim is not None:
            multiple = rules.zero_multiple(axes, dim, zero_size, tensor_size)
            padded[dim] = -(-shape[dim] // multiple) * multiple
        return LeafLayout(axes, shape, dim, tuple(padded), pipeline_dim)

    leaves = jax.tree_util.tree_map_with_path(
        leaf_layout, logical, shapes, is_leaf=lambda x: isinstance(x, P)
    )
    return StateLayout(get_stage(parallel.zero_stage), mesh, leaves)
