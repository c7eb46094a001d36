"""stages/call_series.py: what the calls of one strategy share, in one process (no process group: every
collective is this rank's alone). The folder is claimed once per folder asked for; the writer is made once per
folder; a call's end is agreed on the job's key-value store; a write's failure is said until acknowledged."""

from __future__ import annotations

import pytest
import torch

from stagesafe.errors import DistributedStageError, HandoffExistsError
from stagesafe.publishing.save import save_state_dict
from stagesafe.stages.call_series import FAILURE_GRACE, CallSeries

pytestmark = pytest.mark.timeout(120)


def _series(**kwargs) -> CallSeries:
    options = {"storage_options": None, "resume_from": None, "overwrite": False}
    return CallSeries(**{**options, **kwargs})


def test_a_folder_is_claimed_once_and_its_target_carries_the_strategys_arguments(tmp_path):
    series, said = _series(storage_options={"auto_mkdir": True}), []
    asked = str(tmp_path / "handoff")
    first = series.target(asked, named=True, on_versioned=lambda *pair: said.append(pair))
    save_state_dict({"w": torch.ones(2)}, asked)  # another writer's handoff appears: the claim stands
    again = series.target(asked, named=True, on_versioned=lambda *pair: said.append(pair))
    assert first == again and first.uri == asked and said == []
    assert first.storage_options == {"auto_mkdir": True}


def test_a_default_folder_holding_another_runs_handoff_gives_way_and_a_named_one_is_refused(tmp_path):
    asked = str(tmp_path / "stagesafe_handoff")
    save_state_dict({"w": torch.ones(2)}, asked)
    said: list[tuple[str, str]] = []
    target = _series().target(asked, named=False, on_versioned=lambda *pair: said.append(pair))
    assert target.uri == asked + "-v1" and said == [(asked, asked + "-v1")]
    with pytest.raises(HandoffExistsError):
        _series().target(asked, named=True, on_versioned=lambda *pair: said.append(pair))
    assert _series(overwrite=True).target(asked, named=True, on_versioned=print).uri == asked


def test_one_writer_per_folder_and_a_call_that_ended_everywhere_gathers(tmp_path):
    series = _series()
    target = series.target(str(tmp_path / "h"), named=True, on_versioned=print)
    writer = series.writer_for(target, None, world_size=1, meta=False, timeout=30.0, on_commit=print)
    assert series.writer_for(target, None, world_size=1, meta=False, timeout=30.0, on_commit=print) is writer
    assert series.writers(None) == [writer] and series.failure(None) is None
    series.calls += 1
    ending = series.call_ended(failed=False)
    assert ending.gather and not ending.failed and not ending.broken
    with series.collective(None):  # no call failed: the collective runs as it is
        pass
    other = series.writer_for(series.target(str(tmp_path / "g"), named=True, on_versioned=print), None,
                              world_size=1, meta=False, timeout=30.0, on_commit=print)
    assert other is not writer and series.writers(None) == [other]


def test_a_failed_write_is_said_until_acknowledged(tmp_path):
    series = _series()
    target = series.target(str(tmp_path / "h"), named=True, on_versioned=print)
    writer = series.writer_for(target, None, world_size=1, meta=False, timeout=30.0, on_commit=print)
    error = OSError("disk full")
    writer.failed = (target.uri, error)
    assert series.failure(None) == (target.uri, error)
    assert series.acknowledge(None) == (target.uri, error)
    assert series.failure(None) is None and series.acknowledge(None) is None


def test_after_a_failed_call_the_next_collective_meets_first_and_names_the_broken_group(tmp_path):
    series = _series()
    target = series.target(str(tmp_path / "h"), named=True, on_versioned=print)
    series.writer_for(target, None, world_size=1, meta=False, timeout=30.0, on_commit=print)
    series.calls += 1
    ending = series.call_ended(failed=True)  # this rank waits FAILURE_GRACE at most for the others
    assert ending.failed == (0,) and 0 < FAILURE_GRACE <= 60
    with pytest.raises(DistributedStageError, match=r"process group is broken"), series.collective(None):
        raise RuntimeError("gloo: connection reset")
