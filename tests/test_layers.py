"""The packages' layering (docs/concepts.md): no module imports a package above its own.

    ground floor (errors, jsonform, startup, target, xla_cpu, xla_gpu, xla_tpu)
    < model, data < parallel < analysis < train < whatif < study < config < cli

Every import counts, those inside functions too (the CLI imports each command's modules when
it runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "t5scale"
GROUND = ("errors", "jsonform", "startup", "target", "xla_cpu", "xla_gpu", "xla_tpu", "__init__")
LAYERS = [GROUND, ("model", "data"), ("parallel",), ("analysis",), ("train",), ("whatif",),
          ("study",), ("config",), ("commands",), ("cli",)]  # fmt: skip
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def part_of(module: str) -> str:
    """'t5scale.train.setup' → 'train'; 't5scale.xla_gpu' → 'xla_gpu'."""
    return module.split(".")[1] if module.count(".") else "__init__"


def imported(path: Path) -> set[str]:
    """The t5scale modules a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("t5scale")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("t5scale"):
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def upward_imports(package: Path) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        own = path.relative_to(package).parts[0].removesuffix(".py")
        for module in imported(path):
            target = part_of(module)
            if LEVEL[target] > LEVEL[own]:
                bad.append(f"{path.relative_to(package)} imports {module}")
    return bad


def test_every_part_has_a_level():
    parts = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*")
             if p.suffix == ".py" or (p.is_dir() and any(p.glob("*.py")))}  # fmt: skip
    assert parts <= set(LEVEL), parts - set(LEVEL)


def test_no_module_imports_a_package_above_it():
    assert upward_imports(PACKAGE) == []


def test_an_upward_import_is_found(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "x.py").write_text("def f():\n    from t5scale.train import setup\n")
    assert upward_imports(tmp_path) == ["model/x.py imports t5scale.train.setup"]
