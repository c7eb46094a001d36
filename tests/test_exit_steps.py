"""stages/exit_steps.py: every step of an exit is tried, the first failure (a Ctrl+C too) raised after the last
step; each phase's seconds recorded; the cyclic collector paused for the steps and resumed as it was."""

from __future__ import annotations

import gc

import pytest

from stagesafe.stages.exit_steps import FirstFailure, PhaseClock, no_collector_passes


def test_every_step_runs_and_the_first_failure_a_ctrl_c_too_is_raised_after_the_last():
    ran = []
    first = FirstFailure()

    def interrupted():
        ran.append("copy")
        raise KeyboardInterrupt

    def failing():
        ran.append("destroy")
        raise RuntimeError("later")

    assert first.attempt(interrupted) is None
    assert first.attempt(failing) is None
    assert first.attempt(lambda: ran.append("restore") or "plain") == "plain"  # the module is still made plain
    assert ran == ["copy", "destroy", "restore"]
    with pytest.raises(KeyboardInterrupt):  # the first one, not the later RuntimeError
        first.raise_first()


def test_no_failure_raises_nothing_and_hands_back_each_result():
    first = FirstFailure()
    assert first.attempt(lambda: 3) == 3 and first.error is None
    first.raise_first()


def test_the_clock_records_the_seconds_since_the_previous_mark_per_phase():
    phases: dict[str, float] = {}
    clock = PhaseClock(phases)
    clock("gather")
    clock("destroy")
    assert list(phases) == ["gather", "destroy"] and all(seconds >= 0.0 for seconds in phases.values())


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_inside_and_left_as_it_was_after_a_failure_too(enabled):
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with pytest.raises(ValueError), no_collector_passes():
            assert not gc.isenabled()
            raise ValueError
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()
