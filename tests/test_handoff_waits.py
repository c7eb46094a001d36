"""strategy_bases/handoff_waits.py: the handoff's write as the user sees it, in this process (one rank, a real writer of
a real folder, no Trainer). A failed write is raised by ``wait_for_handoff`` until acknowledged, and the report
then says that no write of that stage is there; the Trainer's last hook of a call reports the boundary, or waits
for the write when asked to."""

from __future__ import annotations

import logging
import types

import pytest

from stagesafe.boundary_report import BoundaryReport
from stagesafe.errors import HandoffNotReadyError
from stagesafe.stages.call_series import CallSeries
from stagesafe.strategy_bases.handoff_waits import HandoffWaits, StageReturned

pytestmark = pytest.mark.timeout(60)


class _Strategy(HandoffWaits):
    def __init__(self, root, *, wait_for_write: bool = False) -> None:
        super().__init__()
        self.wait_for_write = wait_for_write
        self.call_series = CallSeries(storage_options=None, resume_from=None, overwrite=False)
        target = self.call_series.target(str(root / "handoff"), named=True, on_versioned=print)
        self.writer = self.call_series.writer_for(target, None, world_size=1, meta=False, timeout=30.0, on_commit=print)
        self.call_series.last_report = BoundaryReport(stage="fit", uri=target.uri, wrote=True)


def test_before_any_call_there_is_no_report_and_nothing_to_wait_for(tmp_path):
    strategy = _Strategy(tmp_path)
    strategy.call_series.last_report = None
    assert strategy.last_boundary is None
    strategy.wait_for_handoff()


def test_a_failed_write_is_raised_until_acknowledged_and_the_report_then_says_no_write(tmp_path):
    strategy = _Strategy(tmp_path)
    uri = strategy.last_boundary.uri
    strategy.writer.failed = (uri, OSError("disk full"))
    for _ in range(2):  # every later call says it, too
        with pytest.raises(HandoffNotReadyError, match=r"the last handoff write to .* failed .*disk full.*acknowledge"):
            strategy.wait_for_handoff()
    strategy.acknowledge_handoff_failure()
    strategy.wait_for_handoff()
    assert strategy.last_boundary.wrote is False and strategy.last_boundary.stage == "fit"


@pytest.mark.parametrize("wait", [False, True])
def test_the_trainers_last_hook_reports_the_boundary_and_waits_when_asked(tmp_path, caplog, wait):
    strategy = _Strategy(tmp_path, wait_for_write=wait)
    strategy.writer.failed = (strategy.last_boundary.uri, OSError("disk full"))
    trainer = types.SimpleNamespace(strategy=strategy)
    with caplog.at_level(logging.INFO, logger="stagesafe"):
        if wait:
            with pytest.raises(HandoffNotReadyError):
                StageReturned().teardown(trainer, None, "fit")  # type: ignore[arg-type]
        else:
            StageReturned().teardown(trainer, None, "fit")  # type: ignore[arg-type]
    assert "disk full" in caplog.text
    StageReturned().teardown(types.SimpleNamespace(strategy=object()), None, "fit")  # another strategy: nothing
