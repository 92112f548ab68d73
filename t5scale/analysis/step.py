"""What one compiled train step costs: memory per device, FLOPs, collectives (step_analysis.json)."""

from __future__ import annotations

from typing import Any

import jax

from t5scale.analysis.flops import training_flops_per_step
from t5scale.analysis.hlo import collective_ops, mesh_axes, summarise
from t5scale.analysis.memory import compiled_memory, per_device_bytes


def analyze_step(
    compiled, setup, compile_time_s: float | None = None, outer_step=None
) -> dict[str, Any]:
    """Memory (XLA's analysis and the ZeRO formula), FLOPs and collectives of `compiled`, the
    train step of `setup` (a t5scale.train.setup.Setup), and with local SGD or DiLoCo of its
    compiled `outer_step`."""
    run, layout, state, precision = setup.run, setup.layout, setup.state, setup.precision
    shardings = setup.state_shardings
    zero_shards = layout.zero_size
    memory = compiled_memory(compiled)
    batch = setup.abstract_batch()
    batch_per_device = per_device_bytes(batch, {name: x.sharding for name, x in batch.items()})
    params_opt = per_device_bytes(
        (state.params, state.opt_state), (shardings.params, shardings.opt_state)
    )
    scattered = layout.stage.shard_gradients
    grads = layout.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.at_rest(scattered), precision.grad_dtype)
    )
    gradients = per_device_bytes(grads, layout.grad_shardings)
    state_bytes = setup.model_state_bytes()
    formula = state_bytes.per_device(layout.stage, zero_shards)
    flops = training_flops_per_step(
        run.model, run.train.batch_size, run.data.input_length, run.data.target_length
    )
    cost = compiled.cost_analysis() or {}
    ops, notes = collective_ops(compiled.as_text())
    return {
        "model": run.model.name,
        "zero_stage": layout.stage.number,
        "mesh": dict(layout.mesh.shape),
        "devices": layout.mesh.size,
        "batch_size": run.train.batch_size,
        "micro_batches": run.train.micro_batches,
        "tokens_per_step": run.tokens_per_step,
        "lengths": [run.data.input_length, run.data.target_length],
        "backend": jax.default_backend(),
        "compile_time_s": compile_time_s,
        "parameters": state_bytes.count,
        "precision": {
            "mode": precision.name,
            "parameters": precision.param_dtype.name,
            "gradients": precision.grad_dtype.name,
            "fp32_master": precision.mixed,
        },
        "padded": layout.padded,
        "memory_per_device": memory,
        "model_state_per_device": {
            # From XLA: the step's arguments less the batch are parameters + optimizer state.
            "xla_parameters_and_optimizer_bytes": memory["argument_bytes"] - batch_per_device,
            "sharded_parameters_and_optimizer_bytes": params_opt,
            "gradient_bytes": gradients,
            "zero_formula_bytes": formula,
            "zero_formula": state_bytes.formula(layout.stage),
        },
        "flops_per_step": {
            "model": flops,
            "model_per_device": flops / layout.mesh.size,
            "xla_cost_analysis_per_device": float(cost.get("flops", 0.0)),
        },
        "collectives": summarise(ops) | notes,
        # Each collective with its replica group (positions in the mesh's device list, which
        # puts processes slowest) and enclosing loop trip counts: what the cluster model times.
        "collective_ops": ops,
        "layers": {
            "encoder": run.model.num_encoder_layers,
            "decoder": run.model.num_decoder_layers,
        },
        "replica_sync": replica_sync(run.sync, dict(layout.mesh.shape), ops, outer_step)
        | outer_state_bytes(state, shardings),
    }


def outer_state_bytes(state, shardings) -> dict[str, int]:
    """Per device: the anchor and outer momentum of local SGD or DiLoCo (sharded over `zero` as
    the optimizer state is), beside the model state above; nothing when replicas step together."""
    if state.outer is None:
        return {}
    return {"outer_state_bytes_per_device": per_device_bytes(state.outer, shardings.outer)}


def with_every(analysis: dict[str, Any], every: int) -> dict[str, Any]:
    """The analysis of the same step with local SGD's or DiLoCo's outer step every `every`
    steps (the programs do not depend on H)."""
    sync = analysis.get("replica_sync", {})
    if "outer_step" not in sync or sync["every"] == every:
        return analysis
    per_step = _per_step(sync["inner_step"], sync["outer_step"], every)
    return analysis | {"replica_sync": sync | {"every": every, "per_step": per_step}}


def _per_step(inner: dict[str, int], outer: dict[str, int], every: int) -> dict[str, float]:
    """Bytes per step: the inner step's, and the outer step's over the H steps it serves."""
    return {name: inner[name] + outer[name] / every for name in inner}


def replica_sync(sync, mesh: dict[str, int], inner_ops: list[dict], outer_step) -> dict[str, Any]:
    """How replicas synchronise and what it moves, per device: the step's collective bytes and
    those over `replica`, the outer step's (local SGD, DiLoCo), and both per step (the outer
    step's over H)."""
    every = sync.every if sync.local else 1

    def totals(ops: list[dict]) -> dict[str, int]:
        over_replica = [op for op in ops if "replica" in mesh_axes(op["group"], mesh)]
        return {
            "bytes": sum(op["count"] * op["bytes"] for op in ops),
            "bytes_over_replica": sum(op["count"] * op["bytes"] for op in over_replica),
        }

    inner = totals(inner_ops)
    result = sync.describe() | {"inner_step": inner}
    if outer_step is not None:
        outer_ops, _ = collective_ops(outer_step.as_text())
        outer = totals(outer_ops)
        result |= {
            "outer_dtype": sync.outer_dtype,
            "outer_step": outer | {"collectives": summarise(outer_ops)},
            "outer_collective_ops": outer_ops,
        }
    else:
        outer = {"bytes": 0, "bytes_over_replica": 0}
    result["per_step"] = _per_step(inner, outer, every)
    return result
