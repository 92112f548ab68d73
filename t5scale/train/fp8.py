"""FP8 matmuls in training: the scales and amax histories of flax's `Fp8Einsum`
(t5scale/model/mt5.py, `FP8_STATE`) as part of the train state.

Delayed scaling, as Transformer Engine and MaxText train: each FP8 matmul keeps a scale and an
amax history for its input, its kernel and its output's gradient; a step quantizes with the
scale made from the history before it, and records its own amax. flax's custom VJPs hand the
next scales and histories back as their "gradients". So here they are:

- differentiated beside the parameters, but never given to the optimizer: no weight decay, no
  clipping, not in the gradient norm; the step replaces them (`TrainState.fp8`);
- combined by max over micro-batches and over the data-parallel devices (the newest amax is the
  largest any of them saw; the older entries and the scales agree everywhere), in one collective
  on one flat buffer, as Transformer Engine reduces amaxes over its data-parallel group;
- replicated on every device at every ZeRO stage: some 72 KiB an encoder layer and 120 KiB a
  decoder layer with histories of 1,024, against megabytes of parameters. Tensor parallelism
  needs nothing more: `tensor` is partitioned by XLA, whose amax is over the whole operand.
  With pipeline stages each stage keeps its own layers' (every FP8 matmul is in a layer stack,
  split over `pipeline` as the parameters are), and a stage's next state is the max over the
  pipeline's ticks as well (`spread_over_ticks`): autodiff would sum them;
- their own checkpoint item (t5scale/train/checkpoint.py), so that a run moves between fp8 and
  mixed precision; `export` and `convert` never see them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5scale.errors import ConfigError
from t5scale.parallel import collectives


def spec(pipeline_stages: int) -> PartitionSpec:
    """Every leaf's: replicated, or its layers split over the pipeline's stages."""
    return PartitionSpec("pipeline") if pipeline_stages > 1 else PartitionSpec()


def shardings(mesh: Mesh, fp8: Any) -> Any:
    """Every device of a (pipeline) stage quantizes with the same scales."""
    return jax.tree.map(lambda _: NamedSharding(mesh, spec(mesh.shape["pipeline"])), fp8)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def spread_over_ticks(fp8: Any, ticks: int) -> Any:
    """The FP8 state once per tick of a pipeline's schedule ([ticks, ...]); the next state it
    gets back is the max over the ticks (a broadcast's transpose would sum them)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (ticks, *x.shape)), fp8)


def _spread_forward(fp8: Any, ticks: int):
    return spread_over_ticks(fp8, ticks), None


def _spread_backward(ticks: int, _, per_tick: Any):
    return (jax.tree.map(lambda x: jnp.max(x, axis=0), per_tick),)


spread_over_ticks.defvjp(_spread_forward, _spread_backward)


def lowest_like(fp8: Any) -> Any:
    """The start of a max over micro-batches."""
    return jax.tree.map(lambda x: jnp.full(x.shape, -jnp.inf, x.dtype), fp8)


def merge(a: Any, b: Any) -> Any:
    """Two micro-batches' next FP8 state as one."""
    return jax.tree.map(jnp.maximum, a, b)


def max_over_devices(fp8: Any, axes: tuple[str, ...], after: Any) -> Any:
    """The next FP8 state, the max over the manual `axes`, in one pmax of one flat buffer
    issued after every array in `after` (collectives.in_order's reason)."""
    leaves, treedef = jax.tree.flatten(fp8)
    if not leaves or not axes:
        return fp8
    flat = jnp.concatenate([leaf.reshape(-1) for leaf in leaves])
    flat = lax.pmax(collectives.ordered_after(flat, after), axes)
    sizes = [leaf.size for leaf in leaves]
    pieces = jnp.split(flat, np.cumsum(sizes)[:-1].tolist())
    return jax.tree.unflatten(
        treedef, [piece.reshape(leaf.shape) for piece, leaf in zip(pieces, leaves, strict=True)]
    )


def check_supported(platform: str, local_sync: bool) -> None:
    """One ConfigError line where FP8 is asked for what it is not built for."""
    if platform == "tpu":
        raise ConfigError(
            "PrecisionConfig.mode='fp8' is for Hopper GPUs (FP8 cuBLASLt GEMMs); TPUs run mixed "
            "precision here: use gin/precision/mixed.gin"
        )
    if local_sync:
        raise ConfigError(
            "PrecisionConfig.mode='fp8' with local SGD or DiLoCo is not built yet: use "
            "ReplicaSyncConfig.mode='every_step', or mixed precision"
        )
