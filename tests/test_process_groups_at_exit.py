"""The process groups DeepSpeed started for the strategy are ended at exit; a group the user started is not.

A gloo group alive at the interpreter's teardown can abort a rank after all its work (exit -6, "terminate called
without an active exception"): scripts that end right after ``fit`` did so at random. The abort is rare, so the
tests check its cause instead: whether the groups are still up, and their gloo threads running, once the
strategy's exit hook has run.
"""

from __future__ import annotations

import json
import os

import pytest

from _launch import run_ranks

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "end_after_fit.py")

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def _at_exit(tmp_path, mode: str) -> list[list[str]]:
    spec = {"mode": mode, "root": str(tmp_path), "handoff_uri": str(tmp_path / "handoff"), "max_steps": 2}
    results = run_ranks(SCRIPT, [json.dumps(spec)], timeout=240, cwd=str(tmp_path))
    return [[line.split()[1:] for line in r.stdout.splitlines() if line.startswith("AT_EXIT ")] for r in results]


def test_a_script_that_ends_after_fit_and_test_has_its_process_groups_ended_at_exit(tmp_path):
    """After a ``test`` the groups' last references sit in reference cycles: without the collection, six gloo
    threads of two groups were left on each rank, though the groups were destroyed."""
    # rank, torch's group up, DeepSpeed's copy of the world group held, gloo threads left
    assert _at_exit(tmp_path, "groups_at_exit") == [[["0", "False", "False", "0"]], [["1", "False", "False", "0"]]]


def test_a_process_group_the_user_started_is_left_to_the_user(tmp_path):
    reports = _at_exit(tmp_path, "own_group")
    assert [report[:3] for (report,) in reports] == [["0", "True", "True"], ["1", "True", "True"]]
    assert all(int(report[3]) > 0 for (report,) in reports)  # its threads run on: it is still up
