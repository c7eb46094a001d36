"""boundary_report.py: what one stage boundary did, plain data that imports nothing of the package."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import stagesafe.boundary_report
from stagesafe.boundary_report import BoundaryReport


def test_a_report_starts_empty_and_clean_and_each_report_has_its_own_tables():
    first, second = BoundaryReport(stage="fit", uri="h"), BoundaryReport(stage="test", uri="h")
    assert (first.seconds, first.wrote, first.handoff_bytes, first.copied_while_waiting) == (0.0, False, 0, 0)
    first.phases["gather"] = 1.5
    first.stale_problems.append("ds_id on layer.weight")
    assert second.phases == {} and second.clean and not first.clean
    assert dataclasses.replace(first, wrote=True).phases == {"gather": 1.5}


def test_it_imports_nothing_of_the_package_so_that_every_layer_can_import_it():
    tree = ast.parse(pathlib.Path(stagesafe.boundary_report.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported == {"__future__", "dataclasses"}
