"""No import cycles among the modules of t5scale/analysis, t5scale/train and t5scale/whatif,
and nothing above model/ imported by it: every import counts, at the top of a module, inside a
function or under TYPE_CHECKING."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "t5scale"


def imports_of(path: Path) -> set[str]:
    """The modules (and names in them) that the module at `path` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def imports_within(package: str) -> dict[str, set[str]]:
    """Each module of t5scale.`package` and the modules of that package it imports."""
    modules = {f"t5scale.{package}.{path.stem}": path for path in (PACKAGE / package).glob("*.py")}
    return {name: (imports_of(path) & modules.keys()) - {name} for name, path in modules.items()}


def cycle(imported: dict[str, set[str]]) -> list[str] | None:
    """One chain of imports that comes back to where it started, if there is any."""
    done: set[str] = set()

    def visit(name: str, chain: list[str]) -> list[str] | None:
        if name in chain:
            return chain[chain.index(name) :] + [name]
        if name in done:
            return None
        for other in sorted(imported[name]):
            if found := visit(other, [*chain, name]):
                return found
        done.add(name)
        return None

    return next(filter(None, (visit(name, []) for name in sorted(imported))), None)


def test_a_cycle_is_found_where_there_is_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("package", ["analysis", "train", "whatif"])
def test_no_module_imports_one_that_imports_it(package):
    imported = imports_within(package)
    assert len(imported) > 5
    assert cycle(imported) is None


def test_model_imports_nothing_above_itself():
    """model/ is the lowest layer: the attention kernels' backend reaches it as a value."""
    above = sorted(
        f"{path.name} imports {name}"
        for path in (PACKAGE / "model").glob("*.py")
        for name in imports_of(path)
        if name.startswith("t5scale") and not name.startswith(("t5scale.model", "t5scale.errors"))
    )
    assert above == []
