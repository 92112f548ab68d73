"""The code's shape, as issue 61 set it: small functions, a short CLI and README, and the
parameter tree's string keys inside model/ (import cycles: test_imports.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "t5scale"
LONGEST_FUNCTION = 60
# Where records meet files: their string keys are the files' own (JSON, a trial's spec and
# result, Hugging Face's config.json and tensor names).
JSON_EDGES = {
    "study/records.py", "study/runner.py", "study/trial.py", "train/metrics.py",
    "whatif/compile.py", "model/hf_import.py", "model/hf_export.py",
}  # fmt: skip
STRING_KEY = re.compile(r'\[\s*"[A-Za-z_]+"\s*\]')


def python_files(*roots: Path) -> list[Path]:
    return sorted(path for root in roots for path in root.rglob("*.py"))


def long_functions(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    found.append(f"{path.name}:{node.lineno} {node.name} ({lines})")
    return found


def test_no_function_is_over_60_lines():
    assert long_functions(python_files(PACKAGE, ROOT / "bench")) == []


def test_long_functions_are_found(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST_FUNCTION))
    (tmp_path / "long.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    found = long_functions([tmp_path / "long.py"])
    assert len(found) == 1 and found[0].endswith(f"long ({LONGEST_FUNCTION + 1})")


def test_the_cli_and_the_readme_are_short():
    assert len((PACKAGE / "cli.py").read_text(encoding="utf-8").splitlines()) <= 350
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


def test_no_bench_file_is_over_400_lines():
    long = [p.name for p in python_files(ROOT / "bench") if len(p.read_text().splitlines()) > 400]
    assert long == []


def string_keys(paths: list[Path]) -> dict[str, int]:
    counts = {}
    for path in paths:
        name = path.relative_to(PACKAGE).as_posix()
        found = sum(bool(STRING_KEY.search(line)) for line in path.read_text().splitlines())
        if found and name not in JSON_EDGES:
            counts[name] = found
    return counts


def test_few_string_key_subscripts_outside_the_json_edges():
    counts = string_keys(python_files(PACKAGE))
    assert sum(counts.values()) <= 25, counts


def test_only_model_knows_the_parameter_trees_keys():
    """params["encoder"]["layers"] and the like: model/'s named accessors elsewhere."""
    tree_keys = re.compile(r'\[\s*"(encoder|decoder|layers|relpos_bias|final_norm|params)"\s*\]')
    outside = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in python_files(PACKAGE)
        if "model" not in path.relative_to(PACKAGE).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if tree_keys.search(line)
    ]
    assert outside == []


def test_only_target_asks_a_device_for_its_platform():
    """t5scale/target.py (with the compile-only machinery it wraps) answers "which platform";
    everything else asks a Target."""
    asks = re.compile(r"default_backend\(\)|(devices?(\(\))?(\[0\])?|device)\.platform\b")
    machinery = {"target.py", "xla_gpu.py", "xla_tpu.py"}
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in python_files(PACKAGE)
        if path.name not in machinery
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line)
    ]
    assert found == []
