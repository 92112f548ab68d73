"""Each ZeRO stage's collective bytes per chip per step, read from XLA:TPU's program, against
the ZeRO formula's (issue 49, point 4): compile-only, no TPU needed (the `tpu` extra).

    python bench/tpu_collective_bytes.py                       # mt5_tiny, fp32, a v5e-8 slice
    python bench/tpu_collective_bytes.py --slice v5p-16 --slices 2 --out runs/tpu_bytes.json

The formula: stages 0 and 1 all-reduce the gradients, stages 1 and 2 all-gather the updated
parameters, stage 2 reduce-scatters the gradients, stage 3 reduce-scatters and gathers what
`zero3_collective_bytes` says (t5scale/analysis/memory.py): each layer gathered for the
forward and again for the backward pass, and the zero group's activations where the vocabulary
tables are split. One micro-batch, fp32 (the formula's gradients are the parameters' dtype).
At long sequences XLA:TPU gathers the tables instead of moving the activations (3.6 MB in
place of the formula's 7.7 MB for mt5_tiny at 1024/229): its choice, not the formula's.
"""

from __future__ import annotations

import argparse
import json
import time

from t5scale.startup import start_jax  # first: JAX on the CPU, quietly, with libtpu here

start_jax()

import flax.linen as nn  # noqa: E402

from t5scale.analysis.memory import model_state_bytes, zero3_collective_bytes  # noqa: E402
from t5scale.config import build_run_config, parse_gin  # noqa: E402
from t5scale.model.mt5 import abstract_params  # noqa: E402
from t5scale.target import Target  # noqa: E402
from t5scale.whatif.compile import compile_for  # noqa: E402
from t5scale.whatif.weak_scaling import weak_scale  # noqa: E402
from t5scale.xla_tpu import TpuSlice, TpuTopology  # noqa: E402


def expected(stage: int, params, run, batch: int) -> dict[str, tuple[str, float]]:
    """{kind: (which bytes, the formula's)} for a stage."""
    state = model_state_bytes(params, {})
    if stage == 3:
        gathered, scattered = zero3_collective_bytes(params, run.model, run.data, batch, 1)
        return {"reduce-scatter": ("operand_bytes", scattered), "all-gather": ("bytes", gathered)}
    reduce = "reduce-scatter" if stage == 2 else "all-reduce"
    wanted = {reduce: ("operand_bytes" if stage == 2 else "bytes", state.gradients)}
    if stage > 0:
        wanted["all-gather"] = ("bytes", state.parameters)
    return wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mt5_tiny")
    parser.add_argument("--slice", default="v5e-8")
    parser.add_argument("--slices", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per chip")
    parser.add_argument("--lengths", default="32,8", help="input,target (the TPU test's)")
    parser.add_argument("--out", help="a JSON file for the rows")
    args = parser.parse_args()
    inputs, targets = (int(n) for n in args.lengths.split(","))
    parse_gin(
        [f"gin/models/{args.model}.gin"], [f"INPUT_LENGTH={inputs}", f"TARGET_LENGTH={targets}"]
    )
    run = build_run_config()
    params = nn.meta.unbox(abstract_params(run.model))
    target = Target.compile_only_tpus(TpuTopology(TpuSlice.named(args.slice), args.slices))
    print(f"{args.model} on {target.compiler_name}: bytes per chip per step, program / formula")
    print("| stage | collective | program | formula | ratio |\n|---|---|---|---|---|")
    rows = []
    for stage in range(4):
        staged = weak_scale(
            run, stage, target.size, args.micro_batch_size, dcn_groups=target.dcn_groups
        )
        started = time.perf_counter()
        found = compile_for(staged, target).analysis.collectives.to_json()
        seconds = time.perf_counter() - started
        for kind, (field, formula) in expected(stage, params, run, staged.train.batch_size).items():
            program = found.get(kind, {}).get(field, 0)
            rows.append({"stage": stage, "collective": kind, "field": field, "program": program,
                         "formula": formula, "compile_s": round(seconds, 1)})  # fmt: skip
            print(f"| {stage} | {kind} ({field}) | {program:,.0f} | {formula:,.0f} | "
                  f"{program / formula:.3f} |", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"model": args.model, "compiler": target.compiler_name, "rows": rows},
                      out, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
