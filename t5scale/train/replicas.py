"""How replicas synchronise: every step (synchronous data parallelism), or every H steps (local
SGD, DiLoCo).

With `every_step` the gradients are reduced over `replica` in each step, as the ZeRO stage says.
With `local_sgd` or `diloco` each replica trains on its own slice of the global batch with its
own parameters and inner optimizer state, and no collective crosses `replica` (the inner step:
the synchronous step of one replica, vmapped over the replicas with `spmd_axis_name='replica'`).
Every H steps the outer step runs:

    Δ = anchor − mean over replicas of their parameters   (one all-reduce over `replica`)
    anchor ← anchor + OuterOptimizer(Δ)                    (DiLoCo: SGD, Nesterov momentum)
    every replica's parameters ← anchor

Local SGD is the outer step with learning rate 1 and no momentum (the anchor becomes the
replicas' mean). Inner optimizer states stay each replica's own, as in DiLoCo (Douillard et al.,
2023, arXiv:2311.08105: outer learning rate 0.7, Nesterov momentum 0.9).

The state in these modes is laid out as:

- `params`, `opt_state`: every leaf with a leading axis of one entry per replica, split over
  `replica`; inside a replica, laid out as the ZeRO stage says (t5scale/parallel/layout.py);
- `outer` (`OuterState`): the anchor — the fp32 parameters as of the last synchronisation — and
  the outer momentum, identical on every replica and sharded over `zero` as the stage shards the
  optimizer state.

Δ is reduced in `outer_dtype`: float32 by default, since it is reduced once per H steps; bfloat16
halves those bytes. DiLoCo reports that its outer gradients tolerate much more than that:
pruning half their values costs little (Douillard et al., 2023, §3) and Streaming DiLoCo
(arXiv:2501.18512) exchanges them in 4 bits without loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5scale.errors import check_field_types
from t5scale.parallel import collectives

MODES = ("every_step", "local_sgd", "diloco")
OUTER_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class OuterSgd:
    """The outer optimizer's settings that apply: SGD's learning rate, and its Nesterov momentum
    (0: plain SGD)."""

    learning_rate: float
    momentum: float


LOCAL_SGD = OuterSgd(learning_rate=1.0, momentum=0.0)  # the anchor becomes the replicas' mean


@dataclasses.dataclass(frozen=True)
class ReplicaSyncConfig:
    """mode: 'every_step', 'local_sgd' or 'diloco'; every: H, inner steps per synchronisation;
    outer_learning_rate and outer_momentum (Nesterov): DiLoCo's outer optimizer; outer_dtype:
    the dtype Δ is reduced in over `replica`."""

    mode: str = "every_step"
    every: int = 1
    outer_learning_rate: float = 0.7
    outer_momentum: float = 0.9
    outer_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.mode not in MODES:
            raise ValueError(f"ReplicaSyncConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.every < 1:
            raise ValueError(f"ReplicaSyncConfig.every must be >= 1, got {self.every}")
        if self.outer_dtype not in OUTER_DTYPES:
            raise ValueError(
                f"ReplicaSyncConfig.outer_dtype must be one of {OUTER_DTYPES}, "
                f"got {self.outer_dtype!r}"
            )
        if self.outer_learning_rate <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(
                "ReplicaSyncConfig: outer_learning_rate must be > 0 and outer_momentum in [0, 1)"
            )

    @property
    def local(self) -> bool:
        """Whether replicas take steps on their own between synchronisations."""
        return self.mode != "every_step"

    def due(self, step: int) -> bool:
        """Whether the outer step runs after `step`."""
        return self.local and step % self.every == 0

    @property
    def outer_sgd(self) -> OuterSgd:
        """The outer step's SGD: local SGD's is fixed (LOCAL_SGD) whatever the fields say,
        DiLoCo's is the fields'."""
        if self.mode == "local_sgd":
            return LOCAL_SGD
        return OuterSgd(learning_rate=self.outer_learning_rate, momentum=self.outer_momentum)

    def describe(self) -> dict[str, Any]:
        """What a checkpoint's meta and the analysis record (their JSON form: SavedSync)."""
        if not self.local:
            return {"mode": self.mode}
        outer = self.outer_sgd
        return {"mode": self.mode, "every": self.every, "outer_learning_rate": outer.learning_rate,
                "outer_momentum": outer.momentum}  # fmt: skip


def outer_optimizer(config: ReplicaSyncConfig) -> optax.GradientTransformation:
    """SGD on Δ: with Nesterov momentum for DiLoCo, learning rate 1 and none for local SGD."""
    outer = config.outer_sgd
    momentum = outer.momentum or None
    return optax.sgd(outer.learning_rate, momentum=momentum, nesterov=momentum is not None)


class OuterState(flax.struct.PyTreeNode):
    anchor: Any  # fp32 parameters at the last synchronisation (the optimizer state's layout)
    momentum: Any  # the outer optimizer's state


def per_replica(tree: Any, replicas: int) -> Any:
    """Each leaf repeated on a new leading axis, one entry per replica."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)


def replica_mean(tree: Any) -> Any:
    """The mean over the leading (replica) axis, in each leaf's own dtype."""
    return jax.tree.map(lambda x: jnp.mean(x, axis=0, dtype=jnp.float32).astype(x.dtype), tree)


def split_over_replicas(shardings: Any, over: str | None = "replica") -> Any:
    """Shardings of the same trees with a leading replica axis, split over `over` (None: whole
    on every device)."""
    return jax.tree.map(
        lambda s: NamedSharding(s.mesh, P(over, *s.spec)),
        shardings,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def specs_over_replicas(specs: Any) -> Any:
    """PartitionSpecs of the same trees with a leading replica axis split over `replica`."""
    return jax.tree.map(lambda spec: P("replica", *spec), specs, is_leaf=lambda x: isinstance(x, P))


def outer_step_per_device(
    outer_tx: optax.GradientTransformation, dtype, replicas: int, outer: OuterState, current: Any
) -> tuple[OuterState, Any]:
    """One device's part of the outer step, inside a shard_map manual over every mesh axis: (the new
    outer state, the parameters every replica restarts from, leading axis of one). `current`: this
    replica's fp32 parameters, laid out as the anchor; Δ is summed over `replica` in `dtype`, in one
    all-reduce of flat buffers (collectives.as_flat_buffer)."""
    differences = jax.tree.map(lambda a, p: (a - p[0]).astype(dtype), outer.anchor, current)
    total = collectives.psum_as_flat_buffers(differences, "replica")
    delta = jax.tree.map(lambda d: d.astype(jnp.float32) / replicas, total)
    updates, momentum = outer_tx.update(delta, outer.momentum, outer.anchor)
    anchor = optax.apply_updates(outer.anchor, updates)
    return OuterState(anchor, momentum), jax.tree.map(lambda a: a[None], anchor)
