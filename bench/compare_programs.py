"""What differs between two runs of bench/same_programs.sh (before and after a change): for each
JSON file, whether it is byte-identical, and otherwise every value that differs, with
`compile_time_s` (a timing, never the same twice) set aside.

    python bench/compare_programs.py BEFORE_DIR AFTER_DIR
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TIMINGS = {"compile_time_s"}


def without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def differences(before: Any, after: Any, path: str = "") -> Iterator[str]:
    if type(before) is not type(after):
        yield f"{path}: {before!r} -> {after!r}"
    elif isinstance(before, dict):
        for key in sorted(before.keys() | after.keys()):
            if key not in before:
                yield f"{path}.{key}: added"
            elif key not in after:
                yield f"{path}.{key}: removed"
            else:
                yield from differences(before[key], after[key], f"{path}.{key}")
    elif isinstance(before, list):
        if len(before) != len(after):
            yield f"{path}: {len(before)} items -> {len(after)}"
        for index, (x, y) in enumerate(zip(before, after, strict=False)):
            yield from differences(x, y, f"{path}[{index}]")
    elif before != after:
        yield f"{path}: {before!r} -> {after!r}"


def main(before_dir: str, after_dir: str) -> None:
    for before in sorted(Path(before_dir).glob("*.json")):
        after = Path(after_dir, before.name)
        if before.read_bytes() == after.read_bytes():
            print(f"{before.name}: byte-identical")
            continue
        found = list(
            differences(
                without_timings(json.loads(before.read_text())),
                without_timings(json.loads(after.read_text())),
            )
        )
        print(f"{before.name}: {len(found)} differences besides compile_time_s")
        for line in found:
            print("   ", line)


if __name__ == "__main__":
    main(*sys.argv[1:])
