"""A background handoff write in the user's world: the script ends right after ``fit``, the write fails as the
process exits, ranks see different folders, a signal arrives while a write waits. Real 2-rank Lightning jobs
on CPU (gloo), started as torchrun would (one process per rank), so that every rank's exit status is seen.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import stagesafe
from _launch import LaunchError, run_ranks, sanitized_env

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "end_after_fit.py")
sys.path.insert(0, os.path.join(HERE, "scripts"))
from toy import ToyModule, state_digest, state_digest_of  # noqa: E402

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def _job(spec: dict, *, timeout: float = 240.0):
    os.makedirs(spec["root"], exist_ok=True)
    return run_ranks(SCRIPT, [json.dumps(spec)], timeout=timeout, cwd=spec["root"])


def _printed(result, key: str) -> str:
    return next(line.split()[1] for line in result.stdout.splitlines() if line.startswith(key + " "))


def test_a_script_that_ends_right_after_fit_leaves_the_trained_weights_committed(tmp_path):
    uri = str(tmp_path / "handoff")
    rank0, rank1 = _job({"mode": "fit", "root": str(tmp_path), "handoff_uri": uri, "max_steps": 3})
    trained = _printed(rank0, "DIGEST")
    assert state_digest_of(stagesafe.load_state_dict(uri)) == trained  # bitwise, after both processes exited
    manifest = stagesafe.verify(uri)
    assert (manifest["metadata"]["stage"], manifest["metadata"]["global_step"]) == ("fit", 3)
    assert state_digest(stagesafe.restore(ToyModule(), uri)) == trained


def test_the_same_through_s3_and_a_later_job_resumes_from_it(s3, tmp_path):
    uri = s3.new_url("ended-after-fit")
    options = s3.storage_options()
    rank0, _ = _job({"mode": "fit", "root": str(tmp_path / "a"), "handoff_uri": uri, "storage_options": options})
    trained = _printed(rank0, "DIGEST")
    assert "stagesafe.json" in s3.objects(uri)
    later, _ = _job({"mode": "resume", "root": str(tmp_path / "b"), "handoff_uri": str(tmp_path / "b" / "h"),
                     "resume_from": uri, "storage_options": options})
    assert _printed(later, "TESTED") == trained


def test_a_write_that_fails_as_the_script_ends_fails_the_process_on_every_rank(s3, tmp_path):
    uri = s3.new_url("refused")
    s3.fail("PUT", r"/model-[0-9a-f]{8}-", 403, "AccessDenied")  # the store refuses the shards, not the probe
    with pytest.raises(LaunchError) as failed:
        _job({"mode": "fit", "root": str(tmp_path), "handoff_uri": uri, "storage_options": s3.storage_options()})
    rank0, rank1 = failed.value.results
    assert _printed(rank0, "DIGEST")  # fit itself returned, and the script ended
    assert rank0.returncode == 1 and rank1.returncode == 1
    for result in (rank0, rank1):
        assert "failed as the interpreter exited" in result.stderr, result.stderr[-2000:]
        assert "exits with status 1" in result.stderr
    assert "access denied" in rank0.stderr
    assert "failed on rank 0" in rank1.stderr or "access denied" in rank1.stderr  # its own share, or rank 0's
    assert not any(name.startswith(("model-", "stagesafe.json")) for name in s3.objects(uri))  # nothing left


def test_ranks_that_see_different_folders_get_the_handoff_in_rank_zeros(tmp_path):
    started = time.monotonic()
    rank0, rank1 = _job({"mode": "per_rank_folders", "root": str(tmp_path), "handoff_uri": None}, timeout=180)
    seconds = time.monotonic() - started
    trained = _printed(rank0, "DIGEST")
    assert _printed(rank0, "TESTED") == trained
    handoff = stagesafe.load_state_dict(str(tmp_path / "rank0" / "stagesafe_handoff"))
    assert state_digest_of(handoff) == trained
    assert not os.path.exists(tmp_path / "rank1" / "stagesafe_handoff" / "stagesafe.json")
    print(f"per-rank folders: fit and test on 2 ranks in {seconds:.1f} s")


def test_fit_again_on_a_trainer_that_reached_max_steps_says_it_will_not_train(tmp_path):
    rank0, _ = _job({"mode": "fit_again", "root": str(tmp_path), "handoff_uri": str(tmp_path / "h"), "max_steps": 2})
    assert _printed(rank0, "AGAIN") == _printed(rank0, "DIGEST")  # Lightning's fit returned without a step
    warned = [line for line in rank0.stdout.splitlines() if line.startswith("WARNING ")]
    assert any("already trained to max_steps=2" in line and "epoch_loop.max_steps" in line for line in warned), warned
    # It changed nothing: the handoff is not written again, and one line says so.
    assert _printed(rank0, "REWRITTEN") == "False"
    assert _printed(rank0, "KEPT_STEPS") == "2"  # the first fit's engine state is still the one kept
    said = [line for line in rank0.stderr.splitlines() if "fit made no optimizer step" in line]
    assert len(said) == 1 and str(tmp_path / "h") in said[0] and "not written again" in said[0], rank0.stderr[-2000:]


_STALLED = """
import signal, sys, torch, torch.distributed as dist
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job ignores Ctrl+C)
from stagesafe.stages.channel import JobChannel
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.stages.writer import HandoffWriter, WriteRequest
uri, where = sys.argv[1], sys.argv[2]
channel = JobChannel(dist.HashStore(), rank=0, world=2, prefix="x", timeout=600)
writer = HandoffWriter(channel, uri, writers=2, timeout=600)
values = {"w": torch.ones(3)}
writer.start(WriteRequest(values=values, plan=plan_handoff(values), metadata={}))
print("waiting for rank 1, which never writes", flush=True)
if where == "join":
    writer.join()
"""


@pytest.mark.parametrize("where", ["join", "exit"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_process_whose_write_waits_for_a_rank_that_is_gone(tmp_path, where, sig):
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALLED, str(tmp_path / "h"), where],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=sanitized_env(),
    )
    assert proc.stdout.readline().startswith("waiting for rank 1")
    time.sleep(0.5)  # in the join, or in the exit hook's join
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the process survived {sig.name}")
    assert proc.returncode != 0
    if sig == signal.SIGINT and where == "exit":
        assert proc.returncode == 130 and "interrupted while the handoff" in err


_COMMITTED_THEN_WAITING = """
import signal, sys, torch, torch.distributed as dist
signal.signal(signal.SIGINT, signal.default_int_handler)
from stagesafe.stages.channel import JobChannel
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.stages.writer import HandoffWriter, WriteRequest
channel = JobChannel(dist.HashStore(), rank=0, world=2, prefix="x", timeout=600)
writer = HandoffWriter(channel, sys.argv[1], writers=1, timeout=600)  # rank 0 writes it all; rank 1 never leaves
values = {"w": torch.ones(3)}
writer.start(WriteRequest(values=values, plan=plan_handoff(values), metadata={}))
print("started", flush=True)
"""


@pytest.mark.parametrize("joined", [False, True], ids=["pending-at-exit", "joined-before-exit"])
def test_ctrl_c_after_the_commit_landed_says_it_was_committed(tmp_path, joined):
    """Rank 0 commits (in the exit hook, or in a join before the script ends), then waits at exit for the others
    to read the outcome: Ctrl+C there ends it with status 130 and says the handoff was committed, no traceback."""
    uri = str(tmp_path / "h")
    script = _COMMITTED_THEN_WAITING + ("writer.join()\n" if joined else "")
    proc = subprocess.Popen(
        [sys.executable, "-c", script, uri],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=sanitized_env(),
    )
    assert proc.stdout.readline().startswith("started")
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(uri, "stagesafe.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # past the commit, in the wait for rank 1
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "it was committed before the interrupt" in err and "not committed" not in err, err
    assert "Traceback" not in err, err  # the old tree, joined: KeyboardInterrupt in threading's exit hook
    assert torch.equal(stagesafe.load_state_dict(uri)["w"], torch.ones(3))


def test_after_fit_only_the_write_is_left_lightnings_thread_check_stops_it_and_its_warnings_are_kept(tmp_path):
    """Lightning's own test suite fails a test that leaves a thread it cannot stop; after fit on 2 ranks the
    background write is the only thread left, its stop() ends it with the handoff committed, and the engine
    that fit built is named as gone."""
    uri = str(tmp_path / "handoff")
    spec = {"mode": "thread_rule", "root": str(tmp_path), "handoff_uri": uri, "max_steps": 3, "max_shard_size": "8KB"}
    rank0, rank1 = _job(spec)  # many small shards: the write is still running when fit returns
    stopped = set(_printed(rank0, "STOPPED").split(","))
    assert "stagesafe-handoff-write" in stopped
    assert stopped <= {"stagesafe-handoff-device", "stagesafe-handoff-write", "stagesafe-hash-stream_0",
                       "stagesafe-transfer_0", "stagesafe-transfer_1", "stagesafe-rm_0"} | {
                       f"stagesafe-hash_{i}" for i in range(64)}
    assert _printed(rank0, "HANDOFF") == _printed(rank0, "DIGEST")  # committed, equal to the module bitwise
    said = rank0.stdout + rank0.stderr  # Lightning's default level shows it, on rank 0 only
    assert f"stagesafe: handoff committed at {uri} (fit, step 3;" in said
    assert "handoff committed" not in rank1.stdout + rank1.stderr
    for result in (rank0, rank1):
        assert "EngineReleasedError: the DeepSpeed engine was destroyed when the last Trainer call returned" in (
            result.stdout
        )
    # stock Lightning's own warnings, on the paths stagesafe overrides
    warned = [line for line in rank0.stdout.splitlines() if line.startswith("WARNING ")]
    assert any("When saving the DeepSpeed Stage 3 checkpoint, each worker will save a shard" in w for w in warned)
    assert any("A single checkpoint file has been given. This means optimizer states cannot be restored." in w
               for w in warned)


def test_a_checkpoint_saved_between_calls_holds_the_files_deepspeeds_own_save_holds(tmp_path):
    """DeepSpeed's save during a stage puts its recovery scripts (zero_to_fp32.py, zero_to_torch.py) beside the
    rank files; trainer.save_checkpoint between calls writes the same list of files, executable the same."""
    rank0, _ = _job({"mode": "files", "root": str(tmp_path), "handoff_uri": str(tmp_path / "h"), "max_steps": 2})
    files = {line.split()[1]: json.loads(line.split(" ", 2)[2]) for line in rank0.stdout.splitlines()
             if line.startswith("FILES ")}
    assert {"zero_to_fp32.py x", "zero_to_torch.py x", "latest"} <= set(files["during"]), files["during"]
    assert files["between"] == files["during"]


def test_deepspeed_saving_into_a_weights_only_checkpoint_folder_removes_its_marker(tmp_path):
    """save_checkpoint(p) between calls without the optimizer state marks p weights-only; DeepSpeed saving
    into p during a later fit writes the optimizer state there, and a resume from p must take it."""
    rank0, _ = _job({"mode": "marker", "root": str(tmp_path), "handoff_uri": str(tmp_path / "h"), "max_steps": 2})
    assert _printed(rank0, "MARKER") == "False"
    warned = [line for line in rank0.stdout.splitlines() if line.startswith("WARNING ")]
    assert not any("optimizer starts afresh" in w or "no optimizer state" in w for w in warned), warned


def test_a_remote_resume_from_with_nothing_there_fails_on_every_rank_before_deepspeed_starts(s3, tmp_path):
    missing = s3.new_url("never-written")
    with pytest.raises(LaunchError) as failed:
        _job({"mode": "resume", "root": str(tmp_path), "handoff_uri": str(tmp_path / "h"), "resume_from": missing,
              "storage_options": s3.storage_options()})
    for result in failed.value.results:
        assert result.returncode != 0
        assert "HandoffNotFoundError" in result.stderr and "never-written" in result.stderr, result.stderr[-2000:]
        assert "initializing deepspeed distributed" not in result.stderr  # before any process group
