"""Ranks agreeing through the job's key-value store (stagesafe/stages/channel.py), in this process: each rank a
thread with its own channel on one real TCPStore, as the ranks of a job share their group's store."""

from __future__ import annotations

import json
import time

import pytest
from _launch import on_every_rank, store_channels

from stagesafe.errors import DistributedStageError
from stagesafe.stages.channel import Ending, Outcome, agree_on_ending, failures

pytestmark = pytest.mark.timeout(120)


def test_an_outcome_is_json_with_a_status_and_the_errors_text():
    failed = Outcome.of(OSError("disk full"))
    assert json.loads(failed.encode()) == {"status": "failed", "error": "OSError: disk full"}
    assert Outcome.decode(failed.encode()) == failed and not failed.ok
    done = Outcome.of(None, {"model-1.safetensors": ["xxh3", "ab", 12]})
    assert json.loads(done.encode()) == {"status": "ok", "value": {"model-1.safetensors": ["xxh3", "ab", 12]}}
    assert Outcome.decode(done.encode()) == done and done.ok
    with pytest.raises(DistributedStageError, match="where an outcome belongs: do all ranks run the same"):
        Outcome.decode('"ok"')
    with pytest.raises(DistributedStageError, match="where an outcome belongs: do all ranks run the same"):
        Outcome.decode(json.dumps({"status": "maybe"}))
    with pytest.raises(DistributedStageError, match="where an outcome belongs: do all ranks run the same"):
        Outcome.decode("failed: the old form")


def test_a_failed_ranks_outcome_reaches_the_other_rank_as_failures():
    channels = store_channels(2)

    def rank(r: int) -> dict[int, str]:
        error = RuntimeError("the disk is full") if r == 1 else None
        step = channels[r].sub("step")
        step.post_outcome(str(r), Outcome.of(error))
        step.wait(["0", "1"], what="the step")
        return failures({o: step.outcome(str(o)) for o in range(2)})

    assert on_every_rank(rank, 2) == [{1: "RuntimeError: the disk is full"}] * 2


def test_failures_are_bounded_in_length():
    (one,) = failures({3: Outcome(error="x" * 10_000)}).values()
    assert len(one) < 500 and one.endswith("...")
    assert failures({0: Outcome(), 1: Outcome(value=[1])}) == {}


def test_a_bounded_wait_names_the_rank_that_did_not_answer():
    channels = store_channels(3, timeout=1.0)
    for r in (0, 1):
        channels[r].sub("ready").post(str(r), "")
    started = time.monotonic()
    with pytest.raises(DistributedStageError, match=r"^the step: no word after 1 s from rank 2\. ") as caught:
        channels[0].sub("ready").wait(["0", "1", "2"], what="the step")
    assert 1.0 <= time.monotonic() - started < 10
    assert caught.value.failures == {}  # a rank that never answered reported nothing


def test_exchange_and_decide_give_every_rank_the_same_answer():
    channels = store_channels(2)

    def rank(r: int):
        values = channels[r].exchange("names", f"rank{r}", what="the names")
        return values, channels[r].decide("leader", f"rank{r}")

    (values0, leader0), (values1, leader1) = on_every_rank(rank, 2)
    assert values0 == values1 == {0: "rank0", 1: "rank1"}
    assert leader0 == leader1 and leader0 in ("rank0", "rank1")


def test_ranks_that_all_end_their_call_agree_to_gather_and_learn_who_failed():
    channels = store_channels(2)
    endings = on_every_rank(lambda r: agree_on_ending(channels[r], failed=(r == 1), grace=10), 2)
    assert endings == [Ending(gather=True, failed=(1,), absent=())] * 2


def test_a_rank_that_does_not_reach_the_end_is_absent_and_nobody_gathers():
    channels = store_channels(2, timeout=30)
    started = time.monotonic()
    ending = agree_on_ending(channels[0], failed=True, grace=0.5)  # rank 1 is still inside the call
    assert time.monotonic() - started < 10  # a failed rank waits the grace, not the timeout
    assert ending == Ending(gather=False, failed=(0,), absent=(1,)) and ending.broken
    late = agree_on_ending(channels[1], failed=False, grace=0.5)  # rank 1 arrives: the decision stands
    assert late == Ending(gather=False, failed=(0,), absent=())
