"""What one compiled train step costs: memory per device, FLOPs, collectives (step_analysis.json)."""

from __future__ import annotations

from typing import Any

import jax

from t5scale.analysis.flops import training_flops_per_step
from t5scale.analysis.hlo import collective_stats
from t5scale.analysis.memory import compiled_memory, model_state_bytes, per_device_bytes
from t5scale.data.synthetic import batch_shapes
from t5scale.train.state import abstract_state, state_shardings


def analyze_step(compiled, run, plan, tx, compile_time_s: float | None = None) -> dict[str, Any]:
    """Memory (XLA's analysis and the ZeRO formula), FLOPs and collectives of a compiled step."""
    state = abstract_state(run.model, tx)
    shardings = state_shardings(plan, tx, state)
    devices = plan.mesh.size
    zero_shards = plan.mesh.shape["zero"]
    memory = compiled_memory(compiled)

    batch_global = sum(
        4 * b * length for b, length in batch_shapes(run.data, run.train.batch_size).values()
    )
    batch_per_device = batch_global // (plan.mesh.shape["replica"] * zero_shards)
    params_opt = per_device_bytes(
        (state.params, state.opt_state), (shardings.params, shardings.opt_state)
    )
    gradients = per_device_bytes(state.params, plan.grad_shardings)
    formula = model_state_bytes(state.params, state.opt_state).per_device(plan.stage, zero_shards)

    flops = training_flops_per_step(
        run.model, run.train.batch_size, run.data.input_length, run.data.target_length
    )
    cost = compiled.cost_analysis() or {}
    return {
        "model": run.model.name,
        "zero_stage": plan.stage.stage,
        "mesh": dict(plan.mesh.shape),
        "devices": devices,
        "backend": jax.default_backend(),
        "compile_time_s": compile_time_s,
        "parameters": sum(x.size for x in jax.tree.leaves(state.params)),
        "memory_per_device": memory,
        "model_state_per_device": {
            # From XLA: the step's arguments less the batch are parameters + optimizer state.
            "xla_parameters_and_optimizer_bytes": memory["argument_bytes"] - batch_per_device,
            "sharded_parameters_and_optimizer_bytes": params_opt,
            "gradient_bytes": gradients,
            "zero_formula_bytes": formula,
        },
        "flops_per_step": {
            "model": flops,
            "model_per_device": flops / devices,
            "xla_cost_analysis_per_device": float(cost.get("flops", 0.0)),
        },
        "collectives": collective_stats(compiled.as_text()),
    }
