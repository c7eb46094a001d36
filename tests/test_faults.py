"""Faults in 2-rank CPU jobs (ZeRO-3, bf16, one process per rank), each surfacing with its real cause.

Every case asserts each rank's exit status, the error each rank saw, and the handoff afterwards. The cases
where one rank fails alone wait for the process group's timeout (20 s here) and are marked ``slow``.
"""

from __future__ import annotations

import os

import pytest

from _launch import run_recorded

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "faults.py")
PAGE = 4096

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def _run(case: str, root, handoff: str | None = None, *, expect_ok: bool = True):
    args = [case, str(root)] + ([handoff] if handoff else [])
    return run_recorded(SCRIPT, args, timeout=300, cwd=str(root), expect_ok=expect_ok)


def _full_disk(tmpfs) -> str:
    """A handoff folder on a 64 KiB disk that a file beside it fills but for one page: room for the strategy's
    probe of the folder, none for the handoff."""
    disk = tmpfs("64k")
    with open(os.path.join(disk.path, "filler"), "wb") as f:
        f.write(b"\0" * (64 * 1024 - PAGE))
    return os.path.join(disk.path, "handoff")


def _error(record: dict) -> str:
    return "" if record["error"] is None else f"{record['error']['type']}: {record['error']['message']}"


def test_a_background_write_that_fails_as_the_script_ends_fails_every_rank_and_leaves_nothing(tmpfs, tmp_path):
    handoff = _full_disk(tmpfs)
    results, records = _run("disk_full_at_exit", tmp_path, handoff, expect_ok=False)
    assert [r.returncode for r in results] == [1, 1]
    assert records[0][0]["error"] is None  # fit itself returned
    assert "No space left on device" in results[0].stderr
    assert "failed on rank 0" in results[1].stderr
    assert [f for f in os.listdir(handoff) if not f.startswith(".")] == []  # the failed write left no file


def test_a_failed_background_write_is_raised_by_the_next_fit_on_every_rank(tmpfs, tmp_path):
    handoff = _full_disk(tmpfs)
    results, records = _run("disk_full_then_fit", tmp_path, handoff)
    for rank in (0, 1):
        first, raised, again, joined = records[rank]
        assert first["error"] is None
        assert raised["error"] is not None and raised["digest"] == first["digest"]  # nothing lost
        assert ("No space left" if rank == 0 else "failed on rank 0") in _error(raised)
        assert again["error"] is None
    assert records[0][3]["handoff_digest"] == records[0][2]["digest"]


def test_after_a_failed_write_every_later_wait_and_boundary_line_say_so_until_acknowledged(tmpfs, tmp_path):
    handoff = _full_disk(tmpfs)
    results, records = _run("disk_full_wait_again", tmp_path, handoff)
    for rank in (0, 1):
        fit, first, second, third, acknowledged = records[rank]
        assert fit["error"] is None
        assert ("No space left" if rank == 0 else "failed on rank 0") in _error(first)
        for again in (second, third):  # the old tree: returned as if the handoff held the weights
            assert again["error"]["type"] == "HandoffNotReadyError", _error(again)
            assert "No space left" in again["error"]["message"] or "failed on rank 0" in again["error"]["message"]
            assert "acknowledge_handoff_failure()" in again["error"]["message"]
        assert acknowledged["error"] is None
    lines = [line for line in results[0].stderr.splitlines() if "fit boundary" in line]
    assert len(lines) == 5, lines  # the call's own, then one per wait
    assert all("handoff write FAILED" in line for line in lines[1:4]), lines
    assert "FAILED" not in lines[4] and "handoff unchanged at" in lines[4], lines  # the old tree: "written at"


def test_rank_0_killed_during_the_background_write_is_named_on_rank_1_as_a_distributed_stage_error(tmp_path):
    results, records = _run("rank0_killed_mid_write", tmp_path, expect_ok=False)
    assert results[0].returncode == -9
    fit, joined = records[1]
    assert fit["error"] is None
    assert joined["error"]["type"] == "DistributedStageError", _error(joined)  # the old tree: DistNetworkError
    assert "rank 0 did not answer" in joined["error"]["message"] and "stagesafe verify" in joined["error"]["message"]
    assert not os.path.exists(os.path.join(tmp_path, "handoff", "stagesafe.json"))  # nothing committed


def test_rank_0_stays_at_exit_until_a_slower_rank_has_read_its_word_on_the_commit(tmp_path):
    """Both ranks join the write and the script ends; rank 0, whose process hosts the job's key-value store, would
    end at once while rank 1's write thread (3 s late here) still has to read rank 0's word there."""
    results, records = _run("rank1_slow_to_read", tmp_path)
    assert [r.returncode for r in results] == [0, 0]
    (fit0, joined0), (fit1, joined1) = records[0], records[1]
    assert joined1["error"] is None, _error(joined1)  # the old tree: DistributedStageError, "rank 0 did not answer"
    assert fit0["error"] is None and fit1["error"] is None and joined0["error"] is None
    assert joined0["handoff_digest"] == fit0["digest"] == fit1["digest"]


def test_a_deleted_handoff_is_written_again_by_the_next_stage(tmp_path):
    _, records = _run("vanished", tmp_path)
    fit, joined, test, rejoined = records[0]
    assert joined["handoff_digest"] == fit["digest"]
    assert test["error"] is None and rejoined["error"] is None
    assert rejoined["handoff_digest"] == fit["digest"] == test["digest"]  # there again, the same bits


def test_a_deleted_handoff_in_meta_mode_is_named_on_every_rank_before_anything_touches_meta_tensors(tmp_path):
    _, records = _run("vanished_meta", tmp_path)
    for rank in (0, 1):
        test = records[rank][2]
        assert test["error"]["type"] == "HandoffNotFoundError", _error(test)
        assert "FileNotFoundError" in test["error"]["mro"]
        assert str(tmp_path / "handoff") in test["error"]["message"]
        assert "NotImplementedError" not in test.get("traceback", "")


def test_a_rewritten_handoff_names_the_stage_and_step_its_weights_come_from(tmpfs, tmp_path):
    handoff = _full_disk(tmpfs)
    _, records = _run("failed_write_metadata", tmp_path, handoff)
    fit, failed_join, test, joined = records[0]
    assert "No space left" in _error(failed_join)
    assert test["error"] is None and joined["error"] is None
    assert joined["handoff_digest"] == fit["digest"]
    meta = joined["handoff_metadata"]
    assert (meta["stage"], meta["global_step"]) == ("fit", 4), meta


@pytest.mark.slow
def test_one_rank_failing_in_validation_never_aborts_the_other_and_the_next_call_says_why(tmp_path):
    results, records = _run("one_rank_fails_in_validation", tmp_path)
    assert [r.returncode for r in results] == [0, 0]  # no SIGABRT from a mismatched collective
    assert "rank 1 fails alone in validation_step" in _error(records[1][0])
    assert records[0][0]["error"] is not None  # rank 0's collective timed out
    for rank in (0, 1):
        fit = records[rank][1]
        assert fit["error"]["type"] == "DistributedStageError", _error(fit)
        assert "restart the job" in fit["error"]["message"].lower() and "resume_from" in fit["error"]["message"]
        assert fit["digest"] is not None  # the module still holds its weights


@pytest.mark.slow
def test_after_one_rank_failed_in_training_later_calls_say_the_process_group_is_broken(tmp_path):
    results, records = _run("one_rank_fails_in_training", tmp_path)
    assert [r.returncode for r in results] == [0, 0]
    assert "rank 1 fails alone in training_step" in _error(records[1][0])
    for rank in (0, 1):
        test = records[rank][1]
        assert test["error"]["type"] == "DistributedStageError", _error(test)
        assert "resume_from" in test["error"]["message"]
