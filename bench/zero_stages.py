"""Per-device memory and collectives of each ZeRO stage, from the compiled step (compile only).

    python bench/zero_stages.py [--models mt5_tiny mt5_small] [--devices 8] [--micro-batches 2]

Prints a markdown table: XLA's per-device memory (arguments, temporaries, peak estimate), the
model-state part (parameters + optimizer state from the step's arguments, gradients from their
sharding) beside the ZeRO formula, and bytes per collective kind per step. Nothing is run, so
models far larger than this machine's memory can be analysed.
"""

from __future__ import annotations

import argparse

import jax

import t5scale  # noqa: F401  (CPU workarounds, before JAX starts)
from t5scale.analysis.hlo import collective_summary
from t5scale.analysis.step import analyze_step
from t5scale.data.synthetic import DataConfig, synthetic_batch
from t5scale.model.sizes import preset
from t5scale.parallel.mesh import ParallelConfig, make_mesh
from t5scale.train import optim
from t5scale.train.config import RunConfig, TrainConfig
from t5scale.train.state import abstract_state, plan_for, state_shardings
from t5scale.train.step import batch_sharding, make_train_step

GIB = 2**30


def analyse(model_name: str, stage: int, devices: int, micro_batches: int, batch: int) -> dict:
    model = preset(model_name)
    data = DataConfig(input_length=512, target_length=114)
    run = RunConfig(
        model=model,
        parallel=ParallelConfig(zero_stage=stage, zero=devices),
        train=TrainConfig(batch_size=batch, micro_batches=micro_batches),
        data=data,
    )
    tx = optim.make_optimizer(run.optimizer)
    plan = plan_for(model, stage, make_mesh(run.parallel, jax.devices()[:devices]))
    step = make_train_step(
        model, plan, tx, state_shardings(plan, tx, abstract_state(model, tx)), micro_batches
    )
    example = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding(plan)),
        synthetic_batch(data, batch, model.vocab_size, 0, 0),
    )
    compiled = step.lower(abstract_state(model, tx), example).compile()
    return analyze_step(compiled, run, plan, tx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mt5_tiny", "mt5_small"])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.devices)
    print(f"{args.devices} devices (zero={args.devices}), batch {args.batch}, {args.micro_batches} "
          "micro-batches, lengths 512/114, AdamW, fp32; memory per device in GiB\n")  # fmt: skip
    print("| model | stage | XLA args | XLA temp | XLA peak | params+opt (XLA) | grads | "
          "model state | ZeRO formula | collectives per step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for stage in range(4):
            a = analyse(name, stage, args.devices, args.micro_batches, args.batch)
            memory, state = a["memory_per_device"], a["model_state_per_device"]
            measured = state["xla_parameters_and_optimizer_bytes"] + state["gradient_bytes"]
            print(
                f"| {name} | {stage} | {memory['argument_bytes'] / GIB:.3f} | "
                f"{memory['temp_bytes'] / GIB:.3f} | {memory['peak_estimate_bytes'] / GIB:.3f} | "
                f"{state['xla_parameters_and_optimizer_bytes'] / GIB:.3f} | "
                f"{state['gradient_bytes'] / GIB:.3f} | {measured / GIB:.3f} | "
                f"{state['zero_formula_bytes']['total'] / GIB:.3f} | "
                f"{collective_summary(a['collectives'])} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
