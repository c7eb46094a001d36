"""stages/collective_guard.py: the guard around the strategy's collectives. After a call that failed on some rank
the ranks meet through the key-value store before the next collective (two ranks as threads of this process on
one real store); a collective that fails once a call failed names the broken process group and what to do."""

from __future__ import annotations

import pytest
from _launch import on_every_rank, store_channels

from stagesafe.errors import DistributedStageError
from stagesafe.stages.channel import Ending
from stagesafe.stages.collective_guard import RESTART, CollectiveGuard

pytestmark = pytest.mark.timeout(120)

_FAILED_ON_1 = Ending(gather=True, failed=(1,), absent=())
_ALL_WELL = Ending(gather=True, failed=(), absent=())


def _never() -> None:
    raise AssertionError("no meeting is due")


def test_after_calls_that_ended_well_a_collective_runs_as_it_is():
    guard = CollectiveGuard()
    guard.call_ended(_ALL_WELL)
    with guard.around([], _never):
        ran = True
    assert ran and guard.failed_ranks is None
    with pytest.raises(RuntimeError, match="gloo"), guard.around([], _never):
        raise RuntimeError("gloo: connection reset")  # not named broken: no call failed


def test_after_a_call_that_failed_on_a_rank_the_ranks_meet_once_before_the_next_collective():
    channels = store_channels(2, prefix="guard")

    def rank(r: int) -> list[str]:
        guard = CollectiveGuard()
        guard.call_ended(_FAILED_ON_1)
        met = []
        with guard.around([], lambda: met.append("met") or channels[r].sub("call-1/met")):
            pass
        with guard.around([], _never):  # met once: the next collective runs as it is
            pass
        return met

    assert on_every_rank(rank, 2) == [["met"], ["met"]]


def test_a_rank_that_never_comes_to_the_meeting_fails_it_naming_the_failed_rank_and_what_to_do():
    channel = store_channels(2, timeout=1.0, prefix="guard-alone")[0]
    guard = CollectiveGuard()
    guard.call_ended(Ending(gather=False, failed=(1,), absent=(1,)))
    with pytest.raises(DistributedStageError, match=r"failed on rank\(s\) \[1\]") as info:
        with guard.around([], lambda: channel.sub("call-1/met")):
            pytest.fail("the collective must not run")
    assert RESTART in str(info.value)


def test_a_collective_that_fails_once_a_call_failed_names_the_broken_group():
    guard = CollectiveGuard()
    guard.call_ended(Ending(gather=False, failed=(), absent=(1,)))  # rank 1 never reached the end
    guard.last_ending = None  # met already
    with pytest.raises(DistributedStageError, match=r"process group is broken .*rank\(s\) \[1\]") as info:
        with guard.around([], _never):
            raise RuntimeError("DistBackendError: timed out")
    assert RESTART in str(info.value) and isinstance(info.value.__cause__, RuntimeError)
