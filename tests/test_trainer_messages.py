"""trainer_messages.py: the lines the strategy says through Lightning's rank-zero logging, each naming the handoff
and what it holds. (The warning for a fit with nothing left to train, on a real Trainer: tests/test_lifecycle.py.)"""

from __future__ import annotations

import logging

import pytest

from stagesafe.boundary_report import BoundaryReport
from stagesafe.publishing.commit import Commit
from stagesafe.trainer_messages import boundary_line, megabytes, say_committed, say_unchanged, say_versioned


def _report(**fields) -> BoundaryReport:
    return BoundaryReport(stage="fit", uri="/runs/h", seconds=1.234, **fields)


def test_the_boundary_line_says_whether_the_handoff_was_written_and_how_large():
    assert boundary_line(_report(), waited=False) == "stagesafe: fit boundary 1.23s; handoff unchanged at /runs/h"
    wrote = _report(wrote=True, handoff_bytes=2_500_000)
    assert boundary_line(wrote, waited=False).endswith("handoff being written in the background at /runs/h (2.5 MB)")
    assert boundary_line(wrote, waited=True).endswith("handoff written at /runs/h (2.5 MB)")


def test_the_boundary_line_says_a_failed_write_and_a_module_left_unclean():
    report = _report(wrote=True, stale_problems=["ds_id on w"])
    line = boundary_line(report, waited=True, failed=("/runs/h", OSError("disk full")))
    assert "handoff write FAILED at /runs/h" in line and "disk full" in line
    assert "does not hold the module's weights" in line and line.endswith("NOT clean: ['ds_id on w']")


def test_sizes_are_said_in_kilobytes_below_a_tenth_of_a_megabyte():
    assert (megabytes(99_999), megabytes(100_000), megabytes(0)) == ("100.0 kB", "0.1 MB", "0.0 kB")


@pytest.fixture
def said(caplog):
    caplog.set_level(logging.INFO)
    return lambda: [r.getMessage() for r in caplog.records]


def test_a_commit_names_the_stage_step_size_and_seconds(said):
    manifest = {"total_size": 3_000_000, "metadata": {"stage": "fit", "global_step": 7}}
    say_committed("/runs/h", Commit(manifest=manifest, replaced=frozenset()), 2.04)
    say_committed("/runs/w", Commit(manifest={"total_size": 10, "metadata": {}}, replaced=frozenset()), 0.1)
    assert said() == ["stagesafe: handoff committed at /runs/h (fit, step 7; 3.0 MB in 2.0 s)",
                      "stagesafe: handoff committed at /runs/w (weights; 0.0 kB in 0.1 s)"]


def test_a_folder_given_way_and_a_fit_that_changed_nothing_are_said(said):
    say_versioned("/runs/stagesafe_handoff", "/runs/stagesafe_handoff-v1")
    say_unchanged("/runs/h")
    first, second = said()
    assert "/runs/stagesafe_handoff holds a handoff of another run" in first and "/runs/stagesafe_handoff-v1" in first
    assert "no optimizer step" in second and "/runs/h already holds them" in second
