"""stagesafe reports through Python logging, as Lightning does: one INFO line per stage boundary on rank 0.

The library itself never prints; only the ``stagesafe`` command writes to the terminal.
"""

from __future__ import annotations

import ast
import os
import re

import pytest
from _launch import run_script

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(os.path.dirname(HERE), "stagesafe")
COMMAND_LINE = {"cli.py"}  # the command's output is its job


def _calls_print(path: str) -> list[int]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("print", "breakpoint"):
                lines.append(node.lineno)
            # sys.stdout.write / sys.stderr.write
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "write"
                and isinstance(func.value, ast.Attribute)
                and func.value.attr in ("stdout", "stderr")
            ):
                lines.append(node.lineno)
    return lines


def test_library_code_never_prints():
    offenders = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            path = os.path.relpath(os.path.join(folder, name), PACKAGE)
            if name.endswith(".py") and path not in COMMAND_LINE:
                lines = _calls_print(os.path.join(folder, name))
                if lines:
                    offenders[path] = lines
    assert not offenders, f"print/sys.stdout.write in library code (use logging.getLogger(__name__)): {offenders}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_log_line_per_boundary_on_rank_zero_only(tmp_path):
    run_script(os.path.join(HERE, "scripts", "boundary_logging.py"), [str(tmp_path)], timeout=200, cwd=str(tmp_path))
    handoff = str(tmp_path / "handoff")
    rank0 = (tmp_path / "rank0.log").read_text().splitlines()
    rank1 = (tmp_path / "rank1.log").read_text().splitlines()
    boundary = [line for line in rank0 if line.startswith("INFO stagesafe.") and " boundary " in line]
    assert [line.split("stagesafe: ", 1)[1].split()[0] for line in boundary] == ["validate", "fit"], rank0
    for line in boundary:
        assert handoff in line  # where
        assert re.search(r"\b\d+\.\d+ ?[kM]B\b", line), line  # how large
        assert re.search(r"\b\d+\.\d+ ?s\b", line), line  # how long
    assert "written" in boundary[1]  # what: fit changed the weights and wrote them
    assert not [line for line in rank1 if line.split(" ", 2)[1:2] and line.split(" ", 2)[1].startswith("stagesafe")]
    # Lightning's own records reach the same handlers: stagesafe logs the way the rest of the run does.
    assert any(" lightning.pytorch" in line for line in rank0)
