"""The GPU check (issue 50): t5scale's kernels, steps and cluster model on one GPU, in one run.

    # on a GPU machine, from a copy of the source tree (docs/gpu_check.md: the wheels it carries)
    PYTHONPATH=.:/tmp/site python3 bench/gpu_check.py --out gpu_check
    python bench/gpu_check.py --dry-run --out /tmp/gpu_check   # CPU: mt5_tiny, the interpreter
    python bench/gpu_check.py --table gpu_check/results.jsonl  # the tables of a run, cut or not

The work list runs most valuable first, each item in a process of its own (one that crashes or
runs out of memory costs that item alone, and each has the device's whole memory and its own
allocator peak), within --budget-s seconds of wall time from the start, compiles included:

1. device: the GPU, driver and jax; the bf16 matmul peak (a chain of 20 8192³ products, median
   of 5) and the device-to-device copy bandwidth (bytes read + written);
2. kernels in bf16 (and, last of all, in fp32): the fused attention kernels
   (t5scale/model/attention_kernels.py) against the einsum path at mT5-Large's shapes (batch 32, 16 heads of 64; the encoder's 1024,
   the causal decoder's 229, the cross attention 229 × 1024), packed with padding: the output's
   and the gradients' (q, k, v, bias) max error relative to the largest value, the same
   measure and tolerance as tests/test_attention.py, each also against fp32 einsums at full
   precision; and milliseconds per forward + backward of each path;
3. steps: mixed precision, batch 32 of 1024/229, AdamW without clipping, synthetic data: the
   median of 10 timed steps after 2 warm-ups, tokens/s, MFU, XLA's and the allocator's peak,
   and the cluster model's prediction for the same program (predict_from_program, the GPU
   path of `t5scale simulate`) with its error. mt5_large and mt5_small with remat dots and
   fused attention, the layers in their loop and unrolled; mT5-XL at the batch that fits;
   mt5_large with remat full, and the einsum ('dot') steps where XLA says they fit; then the
   kernels in fp32.

Results go to OUT/results.jsonl as they come (one JSON line each) and, at the end, to
OUT/gpu_check.md; the log of each item's process to OUT/log.txt, and each step's compiled
program to OUT/programs.zip (the cluster model's reading of it can be redone without a GPU).
--dry-run runs the same work list on the CPU with mt5_tiny at small lengths, the kernels under Pallas's interpreter and the
prediction from the same run compiled for an H100 without one (jax's CUDA plugin): it checks
the script, not a GPU (tests/test_gpu_check.py runs it).

This file is the runner and its command line; beside it, gpu_check_list.py holds the work list
and the results file, gpu_check_items.py the device and step items, gpu_check_kernels.py the
kernels item, and gpu_check_tables.py the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_check_gemms import gemms_item
from gpu_check_head import TILES_VARIABLE as HEAD_TILES_VARIABLE
from gpu_check_head import head_item
from gpu_check_head import tiles_file as head_tiles_file
from gpu_check_items import (
    ROOT,
    device_item,
    h100_program,
    predict_h100,
    start_jax,
    step_item,
    step_run,
    training_loop_item,
)
from gpu_check_kernels import kernels_item
from gpu_check_list import DRY_RUN, GPU, Results, Shapes, lines_of, read_lines, work_list
from gpu_check_tables import tables
from gpu_check_tiles import TILES_VARIABLE, tiles_file

ITEMS = {
    "device": device_item,
    "kernels": kernels_item,
    "head": head_item,
    "gemms": gemms_item,
    "step": step_item,
    "training loop": training_loop_item,
}


# Seconds a step's process takes besides compiling and stepping on the card: Python, JAX and
# CUDA starting, the state's init, the analysis of the program. 12 s on the H200 (2026-11-27:
# each mt5_large item's wall time less its compile and its steps).
STEP_OVERHEAD_S = 12.0
# The card's compile against the same program's compile-only one here: XLA:GPU autotunes its
# GEMMs on the card (11.7 s against 4.5 s, 22.1 s against 6.5 s: mt5_large, fused and dot).
COMPILE_ON_THE_CARD = 3.0


def estimates() -> None:
    """The work list's time on one H100, from programs compiled for it here (no GPU): each
    step's compile time on this machine and the cluster model's step time, as a table."""
    start_jax(False)
    from t5scale.xla_gpu import require_plugin

    require_plugin()  # one line naming the install where jax's CUDA plugin is missing
    print("| item | compile here | predicted step | estimate on an H100 |\n|---|---|---|---|")
    total = 0.0
    for item in work_list(GPU):
        if item.kind != "step":
            print(f"| {item.name} | – | – | {item.estimate_s:.0f} s (the list's figure) |")
            total += item.estimate_s
            continue
        run = step_run(GPU, **item.options)
        started = time.perf_counter()
        analysis = h100_program(run).analysis
        compile_s = time.perf_counter() - started
        predicted = predict_h100(analysis, run)
        steps = GPU.warmup_steps + GPU.timed_steps
        estimate = STEP_OVERHEAD_S + COMPILE_ON_THE_CARD * compile_s + steps * predicted
        total += estimate
        print(f"| {item.name} | {compile_s:.0f} s | {predicted:.3f} s | {estimate:.0f} s |",
              flush=True)  # fmt: skip
    print(f"| all | | | {total:.0f} s |")


# ---------------------------------------------------------------------------------------------
# The parent: runs the work list within the budget, then writes the tables.


def run_all(out: Path, shapes: Shapes, dry_run: bool, budget_s: float, only: list[str],
            tiles: Path | None = None) -> int:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    results_path, log_path = out / "results.jsonl", out / "log.txt"
    results_path.write_text("")
    log_path.write_text("")
    (out / "programs.zip").unlink(missing_ok=True)
    tiles_file(out).unlink(missing_ok=True)  # the kernels item writes it, the steps read it
    head_tiles_file(out).unlink(missing_ok=True)  # the head item's, likewise
    if tiles:  # an earlier sweep's, for a run whose list leaves the kernels item out
        shutil.copyfile(tiles, tiles_file(out))
    # named items from the whole list, extras included; else the default run
    items = [item for item in work_list(shapes, extras=bool(only)) if not only or item.name in only]
    started = time.perf_counter()
    for index, item in enumerate(items):
        elapsed = time.perf_counter() - started
        left = budget_s - elapsed
        estimate_left = sum(i.estimate_s for i in items[index:])
        print(f"[{elapsed:5.0f} s] {index + 1}/{len(items)} {item.name} "
              f"(H100 estimate {item.estimate_s:.0f} s; {estimate_left:.0f} s of the list left, "
              f"{left:.0f} s of the budget)", flush=True)  # fmt: skip
        if left < min(item.estimate_s / 2, 20):
            Results(results_path, item.name).write(status="skipped", why=f"{left:.0f} s left")
            continue
        peak = _measured_peak(results_path)
        command = [sys.executable, __file__, "--item", item.name, "--out", str(out)]
        command += ["--dry-run"] * dry_run + ([f"--peak={peak}"] if peak else [])
        status, why = _run_item(command, out, max(left, 10), item.xla_flags)
        Results(results_path, item.name).write(
            status=status, why=why, wall_s=time.perf_counter() - started - elapsed,
            **({"xla_flags": list(item.xla_flags)} if item.xla_flags else {}),
        )  # fmt: skip
        for line in lines_of(results_path, item.name):
            if "verdict" in line or "step_s" in line or "fits" in line:
                print("        " + _summary(line), flush=True)
    # On a card its minutes go to measuring: the profiles' tables are read afterwards, on any
    # machine, by `--table` (the H200's six took over a minute at the end of a run).
    (out / "gpu_check.md").write_text(tables(results_path, profiles=dry_run))
    print(f"[{time.perf_counter() - started:5.0f} s] done: {out / 'gpu_check.md'}", flush=True)
    print((out / "gpu_check.md").read_text(), flush=True)
    statuses = [line for line in read_lines(results_path) if "status" in line]
    return 0 if all(line["status"] == "done" for line in statuses) else 1


def _run_item(
    command: list[str], out: Path, timeout_s: float, xla_flags: tuple[str, ...] = ()
) -> tuple[str, str | None]:
    log_path = out / "log.txt"
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))  # fmt: skip
    if xla_flags:
        environment["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *xla_flags]).strip()
    environment[TILES_VARIABLE] = str(tiles_file(out))  # the tiles the kernels item chose
    environment[HEAD_TILES_VARIABLE] = str(head_tiles_file(out))  # and the head item
    # JAX's allocator takes 75% of a GPU by default; a step that fits the card should run.
    environment.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    with log_path.open("a") as log:
        flags = f"XLA_FLAGS='{environment['XLA_FLAGS']}' " if xla_flags else ""
        log.write(f"$ {flags}{' '.join(command)}\n")
        log.flush()
        try:
            process = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                     env=environment, timeout=timeout_s)  # fmt: skip
        except subprocess.TimeoutExpired:
            return "cut", f"the budget ran out after {timeout_s:.0f} s"
    if process.returncode == 0:
        return "done", None
    last = [line for line in log_path.read_text().splitlines() if line.strip()][-1:]
    return "failed", f"exit {process.returncode}: {last[0][:300] if last else ''}"


def _measured_peak(path: Path) -> float | None:
    return next((line["bf16_matmul_flops"] for line in read_lines(path)
                 if "bf16_matmul_flops" in line), None)  # fmt: skip


def _summary(line: dict[str, Any]) -> str:
    if "verdict" in line:
        worst = max(line["errors"]["fused_vs_dot"].values())
        return (f"{line['attention']}: {line['verdict']} (fused vs dot {worst:.1e}); "
                f"{line['ms_fused']:.2f} ms fused, {line['ms_dot']:.2f} ms dot")  # fmt: skip
    if "step_s" in line:
        return f"{line['step_s']:.4f} s per step, {line['tokens_per_s']:,.0f} tokens/s"
    return f"XLA peak {line['xla_peak_bytes'] / 2**30:.1f} GiB, fits: {line['fits']}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check"))
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the CPU: mt5_tiny, small lengths, Pallas's interpreter",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="wall seconds for the whole list (items past it are skipped)",
    )
    parser.add_argument(
        "--only", nargs="*", default=[], help="items by name, extras too (default: the list)"
    )
    parser.add_argument(
        "--all", action="store_true", help="the extra items too (the einsum steps, fp32 kernels)"
    )
    parser.add_argument(
        "--tiles",
        type=Path,
        help="the attention tiles an earlier run chose (its attention_tiles.json), for the "
        "steps of a run without the kernels item",
    )
    parser.add_argument("--table", type=Path, help="print the tables of a results.jsonl")
    parser.add_argument(
        "--estimate",
        action="store_true",
        help="the list's time on one H100, from programs compiled for it here",
    )
    parser.add_argument("--item", help=argparse.SUPPRESS)  # one item's process
    parser.add_argument("--peak", type=float, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.table:
        print(tables(args.table), end="")
        return
    if args.estimate:
        estimates()
        return
    shapes = DRY_RUN if args.dry_run else GPU
    if args.all:
        shapes = dataclasses.replace(shapes, extras=True)
    names = [item.name for item in work_list(shapes, extras=True)]
    if unknown := [name for name in [*args.only, *filter(None, [args.item])] if name not in names]:
        sys.exit(
            f"gpu_check: no item {', '.join(map(repr, unknown))}; the list: {', '.join(names)}"
        )
    if args.tiles and not args.tiles.is_file():
        sys.exit(
            f"gpu_check: --tiles {args.tiles}: no such file (an earlier run's attention_tiles.json)"
        )
    if args.item:
        item = next(i for i in work_list(shapes, extras=True) if i.name == args.item)
        results = Results(args.out / "results.jsonl", item.name)
        extra = {"peak": args.peak} if item.kind in ("step", "training loop") else {}
        ITEMS[item.kind](results, shapes, args.dry_run, **extra, **item.options)
        return
    sys.exit(run_all(args.out, shapes, args.dry_run, args.budget_s, args.only, args.tiles))


if __name__ == "__main__":
    main()
