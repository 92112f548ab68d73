"""The cluster model's steps again, from the programs a GPU check brought back: each step item's
program (OUT/programs.zip) timed kernel by kernel with a cluster file as it stands now, beside
what the card measured and what the run predicted with the file it had then (issue 59, point
5: refit a figure, then re-predict every measured step from its own program, no GPU needed).

    python bench/gpu_check_repredict.py gpu_check                      # gin/clusters/h200.gin
    python bench/gpu_check_repredict.py gpu_check --cluster gin/clusters/h100.gin
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path
from typing import Any

from gpu_check_items import ROOT, cluster_from
from gpu_check_list import read_lines


def repredicted(out: Path, cluster_file: Path) -> dict[str, float]:
    """Each program's predicted step in seconds, by its file's name (the item's, spaces as
    underscores), under `cluster_file`."""
    from t5scale.analysis.hlo_module import parse_module
    from t5scale.analysis.kernels import read_program
    from t5scale.whatif.gpu_step import predict_program

    cluster = cluster_from(cluster_file)
    steps = {}
    with zipfile.ZipFile(out / "programs.zip") as programs:
        for name in programs.namelist():
            program = read_program(parse_module(programs.read(name).decode()))
            steps[name.removesuffix(".hlo.txt")] = predict_program(program, cluster).step_s
    return steps


def repredict_table(out: Path, cluster_file: Path) -> str:
    """A markdown row for each re-predicted step: measured, predicted then and now, errors."""
    rows: dict[str, dict[str, Any]] = {}
    for line in read_lines(out / "results.jsonl"):
        rows.setdefault(line["item"].replace(" ", "_"), {}).update(line)
    shown = cluster_file.relative_to(ROOT) if cluster_file.is_relative_to(ROOT) else cluster_file
    text = [f"Re-predicted with {shown} as it stands now:", "",
            "| step | median | back to back | predicted then | predicted now | error | "
            "error, back to back |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, now in repredicted(out, cluster_file).items():
        row = rows.get(name, {"item": name})
        median, back = row.get("step_s"), row.get("back_to_back_s")
        text.append(f"| {row['item']} | {_s(median)} | {_s(back)} | {_s(row.get('predicted_step_s'))} "
                    f"| {_s(now)} | {_error(now, median)} | {_error(now, back)} |")  # fmt: skip
    return "\n".join(text) + "\n"


def _s(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.4f} s"


def _error(predicted: float, measured: float | None) -> str:
    return "–" if not measured else f"{100 * (predicted / measured - 1):+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the GPU check's --out directory")
    parser.add_argument("--cluster", type=Path, default=ROOT / "gin/clusters/h200.gin")
    args = parser.parse_args()
    for needed in (args.out / "results.jsonl", args.out / "programs.zip", args.cluster):
        if not needed.is_file():
            raise SystemExit(
                f"gpu_check_repredict: {needed} not found (a GPU check's --out "
                "holds results.jsonl and, where a step item ran, programs.zip)"
            )
    try:
        print(repredict_table(args.out, args.cluster.resolve()), end="")
    except zipfile.BadZipFile as error:
        raise SystemExit(f"gpu_check_repredict: {args.out / 'programs.zip'}: {error}") from None


if __name__ == "__main__":
    main()
