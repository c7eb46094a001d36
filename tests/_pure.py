"""What a module of the package imports, read from its source, so that a test can say that a module is pure
(no torch, no fsspec) without importing it: the package's ``__init__`` may import torch for its own reasons.
Imports only a type checker reads (under ``if TYPE_CHECKING:``) are left out."""

from __future__ import annotations

import ast
import pathlib
from types import ModuleType

# What a pure module of the format may import: the standard library's plain modules, and the package's own
# pure modules (each has a test saying so).
PURE = {
    "__future__",
    "collections.abc",
    "dataclasses",
    "decimal",
    "hashlib",
    "json",
    "math",
    "re",
    "secrets",
    "typing",
    "stagesafe.errors",
    "stagesafe.handoff",
    "stagesafe.handoff.codec",
    "stagesafe.handoff.digest",
    "stagesafe.handoff.names",
    "stagesafe.handoff.sizes",
    "stagesafe.storage.temp_names",
}


def imports_of(module: ModuleType) -> set[str]:
    """The modules ``module`` imports (``from a import b``: ``a``), but for those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    imported: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    return imported
