"""ZeRO across TPU slices against its formula: for each stage, what a chip hands DCN per step
in XLA:TPU's program beside what the stage needs (t5scale/analysis/memory.py,
dcn_formula_bytes), and XLA's peak memory per chip, on 1 and 2 slices; compile-only, no TPU
needed (the `tpu` extra).

    python bench/tpu_dcn_bytes.py                                  # mt5_small, v5e-16 slices
    python bench/tpu_dcn_bytes.py --slice v5e-256 --stages 2 --layouts zero --out runs/dcn.json

Mixed precision, bf16 compute, 4 sequences of the run's lengths a chip (weak scaling), one
micro-batch. Layouts: `zero`, ZeRO over every chip of every slice (the default across
slices); `replica`, a replica per slice with ZeRO inside it. A point XLA:TPU refuses for
memory is reported as not fitting, with the compiler's figure.
"""

from __future__ import annotations

import argparse
import json
import time

from t5scale.startup import start_jax  # first: JAX on the CPU, quietly, with libtpu here

start_jax()

import jax  # noqa: E402

from t5scale.config import build_hardware, build_run_config, parse_gin  # noqa: E402
from t5scale.target import Target  # noqa: E402
from t5scale.whatif.compile import refusal_of  # noqa: E402
from t5scale.whatif.plan import compile_stage_plan  # noqa: E402
from t5scale.whatif.weak_scaling import weak_scale  # noqa: E402

MB = 1e6


def point(model: str, slice_name: str, slices: int, stage: int, layout: str) -> dict:
    """One stage on `slices` slices in one layout: DCN bytes (program, formula) and memory."""
    generation = slice_name.split("-")[0]
    parse_gin(
        [f"gin/models/{model}.gin", "gin/precision/mixed.gin", f"gin/clusters/tpu_{generation}.gin"],
        ["ModelConfig.dtype='bfloat16'", "DATA_SOURCE='synthetic'",
         f"TpuPodConfig.slice='{slice_name}'", f"TpuPodConfig.slices={slices}"],
    )  # fmt: skip
    run, pod = build_run_config(), build_hardware(required=True)
    target = Target.compile_only_tpus(pod.topology())
    replicas = slices if layout == "replica" else 1
    staged = weak_scale(run, stage, target.size, 4, replicas=replicas, dcn_groups=target.dcn_groups)
    row = {"model": model, "slice": slice_name, "slices": slices, "stage": stage, "layout": layout}
    started = time.perf_counter()
    try:
        plan = compile_stage_plan(staged, target, pod.device_memory_gb * 1e9, pod)
    except jax.errors.JaxRuntimeError as error:
        return row | {"does_not_fit": refusal_of(error, "compile").words}
    memory = plan.analysis.memory_per_device
    return row | {
        "dcn_program": plan.dcn_program.to_json(), "dcn_formula": plan.dcn_formula.to_json(),
        "peak_bytes": memory.peak_estimate_bytes, "argument_bytes": memory.argument_bytes,
        "compile_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip


def line(row: dict) -> str:
    where = f"| {row['stage']} | {row['layout']} | {row['slices']} × {row['slice']} |"
    if "does_not_fit" in row:
        return f"{where} – | – | does not fit: {row['does_not_fit']} |"
    program, formula = row["dcn_program"]["total"], row["dcn_formula"]["total"]
    ratio = f"{program / formula:.3f}" if formula else "–"
    return (
        f"{where} {program / MB:,.1f} | {formula / MB:,.1f} ({ratio}) | "
        f"{row['peak_bytes'] / 1e9:.2f} GB |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mt5_small")
    parser.add_argument("--slice", default="v5e-16")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--layouts", default="zero,replica", help="across slices")
    parser.add_argument("--counts", default="1,2", help="slice counts (1: ZeRO in the slice)")
    parser.add_argument("--out", help="a JSON file for the rows")
    args = parser.parse_args()
    print(f"{args.model}: DCN MB per chip per step (program, formula) and XLA's peak per chip")
    print("| stage | layout | slices | DCN program | DCN formula (ratio) | peak |")
    print("|---|---|---|---|---|---|")
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        counts = [int(n) for n in args.counts.split(",")]
        points = [(1, "zero")] if 1 in counts else []
        points += [(n, layout) for n in counts if n > 1 for layout in args.layouts.split(",")]
        for slices, layout in points:
            rows.append(point(args.model, args.slice, slices, stage, layout))
            print(line(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
