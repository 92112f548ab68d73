"""Workarounds that make XLA's CPU backend safe for programs with many collectives.

t5scale emulates a cluster with many CPU devices in one process, and XLA:CPU runs their
collectives through an in-process rendezvous. Three things break it. They are fixed only where
devices are emulated on the CPU, and explicitly: the CLI, the study's trial processes, the tests,
the benchmarks and the notebook call `emulate_cpu_devices` (or its two halves around
jax.distributed.initialize: `configure_cpu_devices`, then `patch_cpu_collectives`). A GPU or
TPU run never gets the patch of JAX's private lowering (2., 3.); the flag of 1. is an option of
XLA's CPU compiler, which no other compiler reads.

1. XLA's concurrency-optimised CPU scheduler may order independent collectives differently on
   each device, which deadlocks. It is switched off with an XLA flag.
2. JAX lowers every explicit collective (psum, psum_scatter, all_gather, …) with the same channel
   id, 1, and XLA:CPU keys its rendezvous on (run, channel id): a device that reaches the next
   all-gather before the others have left the previous one joins the wrong rendezvous, and the
   process aborts ("Id can't be larger than the number of participating threads") or hangs.
   Here each collective gets its own channel id from the module's own counter, as XLA's SPMD
   partitioner does for the collectives it creates, and collectives are lowered one by one
   rather than once per distinct shape (JAX caches the lowering of identical equations, which
   would copy one id to each). The ids are deterministic per program, so several processes
   lowering the same program agree on them.
3. Inside a shard_map that is manual over some mesh axes and automatic over others, JAX puts a
   sharding annotation on every op's result, the scalar reducer of a collective (its add)
   included. XLA:CPU runs bf16 reduce-scatters and all-reduces in f32 and rebuilds the reducer
   from its root's opcode, which the annotation has made a copy: the compile aborts ("Invalid
   binary instruction opcode copy"). Here the reducer is emitted as its one HLO op.
"""

from __future__ import annotations

import os
import sys
import types

import jax

from t5scale.errors import UnsupportedJaxError
from t5scale.target import Target

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def configure_cpu_devices(count: int) -> None:
    """Before the backend starts: the CPU backend emulates `count` devices and keeps their
    collectives in program order. Neither setting is read by a GPU or TPU backend."""
    jax.config.update("jax_num_cpu_devices", count)
    keep_collectives_in_program_order()


def patch_cpu_collectives() -> bool:
    """Once the distributed runtime (if any) is up: on the CPU backend, give every collective
    its own channel and a plain reducer (2. and 3. above) and say True; on any other backend
    change nothing and say False. An UnsupportedJaxError where this jax cannot be patched."""
    if Target.local().platform != "cpu":
        return False
    if not give_collectives_distinct_channels():
        raise UnsupportedJaxError(
            f"jax {jax.__version__} cannot run t5scale's emulated CPU devices (t5scale/xla_cpu.py "
            "patches a private lowering of the pinned jax release): install the jax that "
            "pyproject.toml pins"
        )
    return True


def emulate_cpu_devices(count: int) -> bool:
    """`configure_cpu_devices`, then `patch_cpu_collectives`, for a process that joins no
    others; call it before anything starts the backend. True on the CPU backend."""
    configure_cpu_devices(count)
    return patch_cpu_collectives()


def keep_collectives_in_program_order() -> None:
    """The scheduler flag in XLA_FLAGS, unless the user set that option already."""
    add_xla_flag(SCHEDULER_FLAG)


def add_xla_flag(flag: str) -> None:
    """Append `flag` ('--option=value') to XLA_FLAGS unless the user set that option already;
    before the backend starts, which reads XLA_FLAGS once."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=", 1)[0].lstrip("-") not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


class _FreshChannelIds(types.ModuleType):
    """Stands in for jax's `mlir` module inside jax's collective lowerings."""

    def __init__(self, mlir: types.ModuleType, reducers: dict):
        super().__init__(mlir.__name__)
        self._mlir = mlir
        self._reducers = reducers  # primitive name → the HLO op that reduces two scalars

    def __getattr__(self, name: str):
        return getattr(self._mlir, name)

    def lower_fun(self, fun, multiple_results: bool = True):
        """jax's lower_fun, but a collective's scalar reducer is emitted as its one HLO op,
        without the sharding annotation that aborts XLA:CPU on bf16 (3. above)."""
        lowering = self._mlir.lower_fun(fun, multiple_results)
        primitive = getattr(fun, "__self__", None)  # reducers are lowered from `primitive.bind`
        emit = self._reducers.get(getattr(primitive, "name", None))
        if emit is None or multiple_results:
            return lowering

        def lower(ctx, *args, **params):
            if params or any(aval.shape != () for aval in (*ctx.avals_in, *ctx.avals_out)):
                return lowering(ctx, *args, **params)
            return [emit(*args)]

        return lower

    @property
    def COLLECTIVE_CHANNEL_ID(self) -> int:  # noqa: N802  (the name jax reads)
        # Read from inside a lowering rule, whose `ctx` holds the module being lowered.
        ctx = sys._getframe(1).f_locals.get("ctx")
        module_context = getattr(ctx, "module_context", None)
        if module_context is None or not hasattr(module_context, "new_channel"):
            return self._mlir.COLLECTIVE_CHANNEL_ID
        return module_context.new_channel()


def give_collectives_distinct_channels() -> bool:
    """Install the channel-id stand-in; False (and nothing changed) if jax's layout differs."""
    try:  # private modules: another JAX release may not have them
        from jax._src import core
        from jax._src.lax import parallel
        from jax._src.lib.mlir.dialects import hlo
    except ImportError:
        return False
    mlir = getattr(parallel, "mlir", None)
    if isinstance(mlir, _FreshChannelIds):
        return True
    uncacheable = getattr(mlir, "_uncacheable_primitives", None)
    if mlir is None or not hasattr(mlir, "COLLECTIVE_CHANNEL_ID") or uncacheable is None:
        return False
    uncacheable.update(p for p in vars(parallel).values() if isinstance(p, core.Primitive))
    reducers = {"add": hlo.add, "max": hlo.maximum, "min": hlo.minimum}
    parallel.mlir = _FreshChannelIds(mlir, reducers)
    return True
