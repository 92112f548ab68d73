"""README.md against the tree: its map of files ("Where things are") names every package and
top-level module of t5scale/ and nothing that is gone; the gin files and documents it points to
exist.

The map is the fenced block under "## Where things are". An entry is a line that starts at the
left margin and the indented lines after it. Its head, up to the first run of two spaces, is a
comma-separated list of paths from the repository's root (a folder ends with "/"); a name
without a "/" is in the first path's folder:

    t5scale/whatif/     weak_scaling.py, compile.py (compile_for, …), plan.py, simulate.py
    t5scale/cli.py, config.py   the command; gin at the edge

In an entry under t5scale/, every other `name.py` is a module of that folder, or, written
`t5scale/…/name.py`, a path from the root. A package's own __init__.py is not named. The map
names every module; the test holds it to what matters most: nothing it names is gone, every
package has a line, every top-level module is named.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MODULE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py)\b")


def readme_map(text: str) -> list[tuple[list[str], str]]:
    """The map's entries: (head paths from the root, the rest of the entry's text)."""
    heading = re.search(r"^## Where things are\s*$", text, re.MULTILINE)
    assert heading, 'README.md has no "## Where things are" section'
    block = re.search(r"^```[^\n]*\n(.*?)^```", text[heading.end() :], re.MULTILINE | re.DOTALL)
    assert block, 'no fenced block under "## Where things are"'
    entries: list[list[str]] = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            assert entries, f"the map starts with an indented line: {line!r}"
            entries[-1].append(line.strip())
        else:
            entries.append([line.rstrip()])
    parsed = []
    for first, *more in entries:
        head, rest = (re.split(r"\s{2,}", first.strip(), maxsplit=1) + [""])[:2]
        items = [item.strip() for item in head.split(",") if item.strip()]
        folder = items[0] if items[0].endswith("/") else items[0].rpartition("/")[0] + "/"
        paths = [item if "/" in item else folder + item for item in items]
        parsed.append((paths, " ".join([rest, *more])))
    return parsed


def named_modules(entries: list[tuple[list[str], str]]) -> tuple[set[str], set[str]]:
    """(the folders under t5scale/ that head an entry, every t5scale/ module path named)."""
    folders, modules = set(), set()
    for paths, rest in entries:
        folder = paths[0] if paths[0].endswith("/") else paths[0].rpartition("/")[0] + "/"
        if not folder.startswith("t5scale/"):
            continue
        folders.add(folder)
        modules.update(path for path in paths if path.endswith(".py"))
        for name in MODULE.findall(rest):
            modules.add(name if name.startswith("t5scale/") else folder + name)
    return folders, modules


def tree(root: Path) -> tuple[set[str], set[str]]:
    """(every folder under t5scale/ that holds a .py file, every t5scale/ module but __init__)."""
    modules = {
        path.relative_to(root).as_posix()
        for path in (root / "t5scale").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    packages = {module.rpartition("/")[0] + "/" for module in modules}
    return packages, {module for module in modules if not module.endswith("/__init__.py")}


def map_problems(text: str, root: Path) -> list[str]:
    """What the README's map gets wrong about the tree at `root`, one line each."""
    entries = readme_map(text)
    folders, named = named_modules(entries)
    packages, modules = tree(root)
    problems = [
        f"the map names {path}, which does not exist"
        for paths, _ in entries
        for path in paths
        if not (root / path).exists()
    ]
    problems += [
        f"the map names {module}, which does not exist" for module in sorted(named - modules)
    ]
    problems += [
        f"the package {package} has no line in the map" for package in sorted(packages - folders)
    ]
    problems += [
        f"the module {module} is not named in the map"
        for module in sorted(modules)
        if module not in named
    ]
    return problems


def test_the_map_matches_the_tree():
    problems = map_problems(README.read_text(encoding="utf-8"), ROOT)
    assert not problems, "README.md's map (Where things are):\n" + "\n".join(problems)


MAP = """## Where things are

```
t5scale/            cli.py (the commands), config.py
t5scale/whatif/     plan.py (per stage), simulate.py;
                    the cluster model: hardware.py
tests/              pytest
```
"""


def fake_tree(tmp_path: Path, modules: list[str]) -> Path:
    for module in ["t5scale/__init__.py", "t5scale/whatif/__init__.py", *modules]:
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("")
    (tmp_path / "tests").mkdir()
    return tmp_path


TREE = ["t5scale/cli.py", "t5scale/config.py", "t5scale/whatif/plan.py"]
TREE += ["t5scale/whatif/simulate.py", "t5scale/whatif/hardware.py"]


def test_the_map_is_parsed_as_written(tmp_path):
    assert map_problems(MAP, fake_tree(tmp_path, TREE)) == []
    entries = readme_map(MAP)
    assert entries[0][0] == ["t5scale/"] and entries[2][0] == ["tests/"]
    assert named_modules(entries) == ({"t5scale/", "t5scale/whatif/"}, set(TREE))
    old_style = "## Where things are\n\n```\nt5scale/cli.py, config.py   gin\n```\n"
    assert named_modules(readme_map(old_style)) == (
        {"t5scale/"},
        {"t5scale/cli.py", "t5scale/config.py"},
    )


@pytest.mark.parametrize(
    "change, problem",
    [
        ("rm t5scale/whatif/hardware.py", "names t5scale/whatif/hardware.py, which does not exist"),
        ("add t5scale/cluster/model.py", "package t5scale/cluster/ has no line"),
        ("add t5scale/target.py", "module t5scale/target.py is not named"),
        ("rm t5scale/config.py", "names t5scale/config.py, which does not exist"),
    ],
)
def test_a_change_to_the_tree_without_the_map_fails(tmp_path, change, problem):
    verb, module = change.split()
    root = fake_tree(tmp_path, [*TREE, module] if verb == "add" else TREE)
    if verb == "rm":
        (root / module).unlink()
    problems = map_problems(MAP, root)
    assert any(problem in line for line in problems), problems


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_files_and_sections_it_points_to_exist():
    text = README.read_text(encoding="utf-8")
    missing = [
        name for name in re.findall(r"\bgin/[\w/]+\.gin\b", text) if not (ROOT / name).is_file()
    ]
    for target, anchor in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", text):
        if re.match(r"\w+:", target):
            continue
        if not (ROOT / target).exists():
            missing.append(target)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / target).read_text(encoding="utf-8"), re.M)
            if anchor not in {slug(heading) for heading in headings}:
                missing.append(f"{target}#{anchor}")
    assert not missing, f"README.md points to what is not there: {sorted(set(missing))}"
