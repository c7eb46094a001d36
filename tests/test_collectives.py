"""stages/collectives.py: a failure on one rank surfaces on every rank, with each failed rank's reason as data,
instead of hanging the others; results travel to every rank. Two gloo ranks in this test run."""

from __future__ import annotations

import pytest
from _launch import two_ranks  # noqa: F401 - a fixture

from stagesafe.errors import DistributedStageError
from stagesafe.stages import collectives

pytestmark = pytest.mark.timeout(120)


def _seen(call) -> dict:
    """What ``call()`` did on this rank, as the old launched script wrote it down."""
    try:
        return {"result": call()}
    except DistributedStageError as exc:
        return {"error": "DistributedStageError", "message": str(exc), "failures": exc.failures}
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return {"error": type(exc).__name__, "message": str(exc)}


def _fail_on_rank_1() -> str:
    if collectives.rank() == 1:
        raise OSError("disk full on rank 1")
    return "fine"


def _fail(exc: BaseException):
    raise exc


def _outcomes() -> dict:
    return {
        "all_ranks": _seen(lambda: collectives.all_ranks(_fail_on_rank_1, "writing shards")),
        "on_rank_zero": _seen(lambda: collectives.on_rank_zero(
            lambda: _fail(PermissionError("read-only folder")), "publishing the handoff")),
        "ok": _seen(lambda: collectives.all_ranks(collectives.rank, "a no-op")),
    }


def test_errors_reach_every_rank(two_ranks):
    rank0, rank1 = two_ranks.run(_outcomes)
    # rank 1 failed: it re-raises its own error; rank 0 learns of it, naming the rank and the reason
    assert rank1["all_ranks"] == {"error": "OSError", "message": "disk full on rank 1"}
    assert rank0["all_ranks"]["error"] == "DistributedStageError"
    assert "writing shards failed on 1 rank(s): rank 1: OSError: disk full on rank 1" in rank0["all_ranks"]["message"]
    assert rank0["all_ranks"]["failures"] == {1: "OSError: disk full on rank 1"}
    # rank 0 failed alone: rank 1 is told instead of waiting
    assert rank0["on_rank_zero"]["error"] == "PermissionError"
    assert rank1["on_rank_zero"]["error"] == "DistributedStageError"
    told = rank1["on_rank_zero"]["message"]
    assert "publishing the handoff failed on rank 0: PermissionError: read-only folder" in told
    assert rank1["on_rank_zero"]["failures"] == {0: "PermissionError: read-only folder"}
    assert rank0["ok"] == {"result": 0} and rank1["ok"] == {"result": 1}


def _interrupted(helper: str, rank: int):
    def fn() -> str:
        if collectives.rank() == rank:
            raise KeyboardInterrupt
        return "fine"

    return getattr(collectives, helper)(fn, "the step")


@pytest.mark.parametrize("helper, interrupted", [("all_ranks", 1), ("on_rank_zero", 0), ("gather_all", 1)])
def test_an_interrupt_on_one_rank_is_told_to_the_others_then_raised_there(two_ranks, helper, interrupted):
    outcomes = two_ranks.run(_interrupted, helper, interrupted)
    assert type(outcomes[interrupted]) is KeyboardInterrupt
    other = outcomes[1 - interrupted]
    assert isinstance(other, DistributedStageError), other  # not the process group's timeout
    assert other.failures == {interrupted: "KeyboardInterrupt: "}


def _ranks_times_ten() -> list[int]:
    return collectives.gather_all(lambda: 10 * collectives.rank(), "the step")


def _rank_zero_fails_gathering() -> list[int]:
    return collectives.gather_all(lambda: 10 // collectives.rank(), "dividing")


def test_gather_all_gives_every_rank_every_result_or_every_failure(two_ranks):
    assert two_ranks.run(_ranks_times_ten) == [[0, 10], [0, 10]]
    own, told = two_ranks.run(_rank_zero_fails_gathering)
    assert type(own) is ZeroDivisionError
    reason = "ZeroDivisionError: integer division or modulo by zero"
    assert isinstance(told, DistributedStageError) and told.failures == {0: reason}
    assert str(told) == f"dividing failed on 1 rank(s): rank 0: {reason}"


def _rank_zero_only() -> tuple[int, list[int]]:
    ran = []
    result = collectives.on_rank_zero(lambda: ran.append(collectives.rank()) or collectives.rank() + 7, "the step")
    return result, ran


def test_on_rank_zero_runs_on_rank_zero_only_and_every_rank_gets_its_result(two_ranks):
    assert two_ranks.run(_rank_zero_only) == [(7, [0]), (7, [])]


def _both_fail() -> str:
    return collectives.all_ranks(lambda: _fail(ValueError(f"bad on rank {collectives.rank()}")), "the step")


def test_ranks_that_all_fail_each_raise_their_own_error(two_ranks):
    assert [str(e) for e in two_ranks.run(_both_fail)] == ["bad on rank 0", "bad on rank 1"]


def test_without_a_process_group_the_helpers_run_here():
    assert (collectives.rank(), collectives.world_size()) == (0, 1)
    assert collectives.on_rank_zero(lambda: 3, "x") == 3
    assert collectives.all_ranks(lambda: 4, "x") == 4
    assert collectives.gather_all(lambda: 5, "x") == [5]
    with pytest.raises(OSError, match="disk full"):
        collectives.all_ranks(lambda: _fail(OSError("disk full")), "x")
