"""The layer rule of docs/how-it-works.md ("The package, and how ranks coordinate"), read from its tables and
checked against every import of the package (ast, imports inside functions too), so the map and the code
cannot drift apart; and every module has a test file of its own."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "stagesafe")
SECTION = "## The package, and how ranks coordinate"


def _tables() -> list[list[list[str]]]:
    """The section's markdown tables, each a list of rows of cells, header row first."""
    with open(os.path.join(ROOT, "docs", "how-it-works.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index(SECTION) + len(SECTION)
    section = text[start : text.find("\n## ", start)]
    tables: list[list[list[str]]] = []
    previous = ""
    for line in section.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|( *-+ *\|)+", line.replace(":", "")):
            if not previous.startswith("|"):
                tables.append([])
            tables[-1].append([cell.strip() for cell in line.strip("|").split("|")])
        previous = line
    return tables


def _units(cell: str) -> list[str]:
    return [name for name in re.findall(r"`([^`]+)`", cell) if name.endswith(("/", ".py"))]


def _layers() -> tuple[list[str], dict[str, set[str]]]:
    """The map's rows in order, and what each may import from stagesafe."""
    table = next(t for t in _tables() if t[0][0] == "where")
    order = [_units(row[0])[0] for row in table[1:]]
    return order, {_units(row[0])[0]: set(_units(row[2])) for row in table[1:]}


def _libraries() -> dict[str, list[str]]:
    table = next(t for t in _tables() if t[0][0] == "library")
    return {row[0].strip("`"): _units(row[1]) for row in table[1:]}


def _modules() -> Iterator[str]:
    """Every module of the package, as its path under stagesafe/."""
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(folder, name), PACKAGE).replace(os.sep, "/")


def _unit_of(path: str, units: list[str]) -> str | None:
    for unit in units:
        if path == unit or (unit.endswith("/") and path.startswith(unit)):
            return unit
    return None


def _path_of(module: str) -> str | None:
    """``stagesafe.a.b`` -> ``a/b.py`` or ``a/b/__init__.py``; None if no such module of the package."""
    parts = module.split(".")[1:]
    for path in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
        if os.path.isfile(os.path.join(PACKAGE, path)):
            return path
    return None


def _imports(path: str) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` of each import in a module; ``from a import b`` names ``a.b`` (a module or a
    name in one), and ``torch.distributed`` reached as an attribute of ``torch`` counts as its import."""
    package = "stagesafe." + path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    if not path.endswith("__init__.py"):
        package = package.rsplit(".", 1)[0]
    with open(os.path.join(PACKAGE, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, up level - 1 packages
                parts = package.split(".")
                parent = parts[: len(parts) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            if isinstance(node.value, ast.Name) and node.value.id == "torch":
                yield node.lineno, "torch.distributed"


def _stagesafe_path(name: str) -> str | None:
    """The package module an imported name lives in (``stagesafe.errors.X`` -> ``errors.py``)."""
    while name.startswith("stagesafe"):
        path = _path_of(name)
        if path is not None:
            return path
        name = name.rpartition(".")[0]
    return None


def test_every_module_is_on_the_map_and_every_row_of_it_is_in_the_package():
    order, _ = _layers()
    assert len(order) == len(set(order)), "a folder or file has two rows"
    assert [m for m in _modules() if _unit_of(m, order) is None] == []
    assert [u for u in order if not any(_unit_of(m, [u]) for m in _modules())] == []


def test_the_map_is_layered():
    order, allowed = _layers()
    for row, units in allowed.items():
        above = order[: order.index(row) + 1]
        assert units <= set(above), f"{row} may import {sorted(units - set(above))}, below it on the map"


def test_no_module_imports_from_stagesafe_what_its_row_does_not_allow():
    order, allowed = _layers()
    broken = []
    for path in _modules():
        unit = _unit_of(path, order)
        for line, name in _imports(path) if unit is not None else ():  # off the map: the first test says so
            target = _stagesafe_path(name)
            if target is not None and _unit_of(target, order) not in allowed[unit]:
                broken.append(f"stagesafe/{path}:{line} imports {name} ({_unit_of(target, order)})")
    assert broken == [], "imports the map of docs/how-it-works.md does not allow:\n" + "\n".join(broken)


def test_lightning_deepspeed_and_torch_distributed_are_imported_only_where_the_map_says():
    libraries = _libraries()
    assert set(libraries) == {"lightning", "deepspeed", "torch.distributed"}
    broken = []
    for path in _modules():
        for line, name in _imports(path):
            for library, where in libraries.items():
                if (name == library or name.startswith(library + ".")) and _unit_of(path, where) is None:
                    broken.append(f"stagesafe/{path}:{line} imports {name}")
    assert broken == [], "imports the map of docs/how-it-works.md does not allow:\n" + "\n".join(broken)


def test_every_module_has_a_test_file_of_its_own():
    """A module ``a/b.py`` (or ``a/_b.py``) is tested by ``tests/test_b.py``, or by ``tests/test_a_b.py`` where
    another module shares its name (``zero/checkpoint.py``: ``tests/test_zero_checkpoint.py``)."""
    tests = set(os.listdir(os.path.join(ROOT, "tests")))
    missing = []
    for path in _modules():
        folder, _, file = path.rpartition("/")
        if file == "__init__.py":
            continue  # a package's face: its names are its modules', tested there
        name = file.removesuffix(".py").lstrip("_")
        parent = folder.rpartition("/")[2]
        if f"test_{name}.py" not in tests and f"test_{parent}_{name}.py" not in tests:
            missing.append(f"stagesafe/{path}")
    assert missing == [], "modules without a test file of their own:\n" + "\n".join(missing)
