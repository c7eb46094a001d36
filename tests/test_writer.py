"""The handoff writer (stagesafe/stages/writer.py), in this process: two ranks as two threads, each with its
channel on one real key-value store (a TCPStore, as in a job), writing real files. Interpreter exit is tested
in subprocesses, where it really happens."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from _launch import on_every_rank, store_channels
from _tensors import Unwritable

import stagesafe
from stagesafe.errors import DistributedStageError, StorageTransferError
from stagesafe.handoff.plan import plan_specs
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.stages.writer import HandoffWriter, WriteRequest, WriteState

pytestmark = pytest.mark.timeout(120)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _values(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 33, generator=g) for i in range(6)} | {"b": torch.arange(7.0)}


def _writers(
    world: int, uri: str | list[str], *, writers: int | None = None, timeout: float = 30.0
) -> list[HandoffWriter]:
    """A writer of the folder ``uri`` on each rank (``uri``: each rank's own, where they do not see one folder)."""
    uris = uri if isinstance(uri, list) else [uri] * world
    channels = store_channels(world, timeout=timeout)
    return [HandoffWriter(c, u, writers=writers or world, timeout=timeout) for c, u in zip(channels, uris)]


def _request(values: dict, **kwargs) -> WriteRequest:
    """As a stage's end asks: the plan made before, of names, dtypes and shapes (it holds no tensor)."""
    planned = plan_handoff(values, max_shard_size=3000)
    plan = plan_specs(planned.tensors, planned.aliases, max_shard_size=3000)
    return WriteRequest(values=values, plan=plan, metadata={"step": 1}, **kwargs)


def _bitwise(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_every_rank_writes_its_share_and_rank_zero_commits(tmp_path):
    uri, values = str(tmp_path / "h"), _values()
    writers = _writers(2, uri)

    def rank(r: int):
        writers[r].start(_request(values))
        return writers[r].join()

    committed, other = on_every_rank(rank, 2)
    assert other is None and committed.manifest["metadata"]["step"] == 1
    assert _bitwise(stagesafe.load_state_dict(uri), values)
    assert stagesafe.verify(uri)
    phases = [w for w in writers if w.pending]
    assert phases == []


def test_ranks_that_do_not_see_the_folder_leave_the_whole_write_to_rank_zero(tmp_path):
    values = _values(1)
    folders = [str(tmp_path / f"rank{r}" / "h") for r in range(2)]  # each rank its own folder
    writers = _writers(2, folders, writers=1)
    results = on_every_rank(lambda r: (writers[r].start(_request(values)), writers[r].join())[1], 2)
    assert results[1] is None and not isinstance(results[0], BaseException)
    assert _bitwise(stagesafe.load_state_dict(folders[0]), values)
    assert not os.path.exists(folders[1])  # rank 1 wrote nothing, and waited for nothing of its own


def test_a_share_that_fails_commits_nothing_leaves_no_shard_and_fails_on_every_rank(tmp_path):
    uri = str(tmp_path / "h")
    stagesafe.save_state_dict(_values(0), uri)
    before = sorted(os.listdir(uri))
    writers = _writers(2, uri)
    failed_on = []

    def rank(r: int):
        values = _values(1)
        if r == 1:  # a value this rank cannot write: its share fails
            values = {**values, "layer5.weight": Unwritable(values["layer5.weight"])}
        request = _request(values, on_failed=lambda: failed_on.append(r))
        writers[r].start(request)
        return writers[r].join()

    zero, one = on_every_rank(rank, 2)
    assert isinstance(one, RuntimeError) and "cannot be written" in str(one)  # rank 1: its own error
    assert isinstance(zero, StorageTransferError) and "on rank 1" in str(zero) and "unchanged" in str(zero)
    assert sorted(failed_on) == [0, 1]  # every rank learns that the handoff does not hold the new weights
    assert sorted(os.listdir(uri)) == before  # no shard of the failed write is left, the old handoff is whole
    assert _bitwise(stagesafe.load_state_dict(uri), _values(0))


def test_a_rank_that_never_writes_is_named_once_the_timeout_is_over(tmp_path):
    uri = str(tmp_path / "h")
    writers = _writers(2, uri, timeout=2.0)
    writers[0].start(_request(_values()))  # rank 1 died before its share
    with pytest.raises(DistributedStageError, match="no word after 2 s from rank 1"):
        writers[0].join()
    assert not os.path.exists(os.path.join(uri, "stagesafe.json"))


def test_the_entry_check_leaves_a_running_write_alone_and_raises_a_failed_one_on_every_rank(tmp_path):
    gate = threading.Event()
    writers = _writers(2, str(tmp_path / "h"))

    def slow_fill() -> None:
        gate.wait(30)

    def rank(r: int) -> str:
        writers[r].start(_request(_values(), fill=slow_fill))
        writers[r].check("entering test")  # rank 0's write waits at the gate: nothing to raise yet
        still = writers[r].pending
        gate.set()
        writers[r].join()
        return still

    assert on_every_rank(rank, 2) == [True, True]

    failing = _writers(2, str(tmp_path / "f"))

    def failing_rank(r: int):
        values = {"x": Unwritable(torch.ones(3))}
        failing[r].start(_request(values))
        if r == 0:
            concurrent.futures.wait([failing[0].committed], timeout=30)  # the failure is known at the next entry
        failing[r].check("entering test")

    zero, one = on_every_rank(failing_rank, 2)
    assert isinstance(zero, RuntimeError) and "cannot be written" in str(zero)
    assert isinstance(one, DistributedStageError) and "failed on rank 0" in str(one)
    assert one.failures == {0: "RuntimeError: this tensor cannot be written"}  # as data, not only in the message
    assert not failing[0].pending and not failing[1].pending


def test_device_work_comes_first_and_the_kept_copy_and_unlocking_wait_for_the_call_to_return(tmp_path):
    order: list[str] = []
    writer = _writers(1, str(tmp_path / "h"))[0]
    values = _values()
    writer.start(_request(values, fill=lambda: order.append("fill"),
                          keep=lambda: order.append("keep"), unlock=lambda: order.append("unlock")))
    time.sleep(0.3)
    assert order == ["fill"]  # the call has not returned: the kept state's memory is held, page-locked stays locked
    writer.call_returned()
    writer.wait_device()
    assert order == ["fill", "keep", "unlock"]
    writer.join()
    assert _bitwise(stagesafe.load_state_dict(str(tmp_path / "h")), values)


def test_one_write_at_a_time():
    writer = _writers(1, "memory://one-at-a-time")[0]
    writer.start(_request(_values()))
    with pytest.raises(RuntimeError, match="before the previous one was joined"):
        writer.start(_request(_values()))
    writer.join()


def test_after_a_failed_call_the_other_ranks_wait_for_rank_zeros_lone_write(tmp_path):
    """Rank 0 writes alone after a call that failed on some rank, and may get there long after the others (it
    first leaves a collective that times out): ``join`` (``wait_for_handoff()``) on rank 1 returns only once
    the handoff is committed."""
    uri, values = str(tmp_path / "h"), _values(3)
    writers = _writers(2, uri, timeout=30)
    rank0_may_write = threading.Event()

    def rank(r: int):
        if r == 0:
            rank0_may_write.wait(30)
            writers[0].write_alone(lambda: stagesafe.save_state_dict(values, uri))
            return None
        writers[1].write_alone(lambda: pytest.fail("only rank 0 writes"))
        threading.Timer(0.5, rank0_may_write.set).start()
        writers[1].join()
        return stagesafe.load_state_dict(uri)

    _, seen = on_every_rank(rank, 2)
    assert _bitwise(seen, values)


def test_a_lone_write_that_fails_is_logged_on_every_rank_and_not_raised(tmp_path, caplog):
    """The stage's own error is the one raised; a failed write after it is logged on every rank."""
    (tmp_path / "a_file").write_text("not a folder")
    uri = str(tmp_path / "a_file" / "h")
    writers = _writers(2, uri, timeout=30)

    def rank(r: int):
        writers[r].write_alone(lambda: stagesafe.save_state_dict(_values(), uri))
        writers[r].join()

    assert on_every_rank(rank, 2) == [None, None]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(m.startswith("stagesafe: could not write the handoff") for m in errors), errors
    assert any(m.startswith("stagesafe: rank 0 could not write the handoff") for m in errors), errors


_EXIT_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from stagesafe.stages.channel import JobChannel
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.stages.writer import HandoffWriter, WriteRequest
uri, mode = sys.argv[1], sys.argv[2]
values = {"w": torch.arange(12.0).reshape(3, 4)}
if mode == "fail":
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.RLIM_INFINITY))
def slow():
    import time; time.sleep(1.0)  # still running when the script's last line has run
channel = JobChannel(dist.HashStore(), rank=0, world=1, prefix="x", timeout=60)
writer = HandoffWriter(channel, uri, writers=1, timeout=60)
writer.start(WriteRequest(values=values, plan=plan_handoff(values), metadata={}, fill=slow))
print("script ends", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_interpreter_exit_finishes_the_write_or_fails_the_process(tmp_path, mode):
    uri = str(tmp_path / "h")
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, uri, mode], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert "script ends" in proc.stdout
    if mode == "ok":
        assert proc.returncode == 0, proc.stderr
        assert torch.equal(stagesafe.load_state_dict(uri)["w"], torch.arange(12.0).reshape(3, 4))
    else:
        assert proc.returncode == 1
        assert "failed as the interpreter exited" in proc.stderr and "File too large" in proc.stderr
        assert not os.path.exists(os.path.join(uri, "stagesafe.json"))


def _stagesafe_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("stagesafe")}


def test_stop_on_a_write_thread_finishes_the_write_and_leaves_its_outcome_to_join(tmp_path):
    """Lightning's test suite calls stop() on every daemon thread a test left and requires it dead after."""
    uri, values = str(tmp_path / "h"), _values()
    writers = _writers(2, uri)
    failed_on = []

    def rank(r: int):
        if r == 1:  # this rank's share fails: the outcome must survive stop() and be raised by join()
            request = _request({**values, "layer5.weight": Unwritable(values["layer5.weight"])},
                               on_failed=lambda: failed_on.append(r))
        else:
            request = _request(values, on_failed=lambda: failed_on.append(r))
        writers[r].start(request)
        return {t for t in _stagesafe_threads() if f" {uri}" in t.name}

    started = on_every_rank(rank, 2)
    threads = started[0] | started[1]
    assert {t.name.split(" ")[0] for t in threads} <= {"stagesafe-handoff-device", "stagesafe-handoff-write"}
    for thread in threads:
        assert thread.daemon and callable(thread.stop)
        thread.stop()
        assert not thread.is_alive()
    assert failed_on == []  # stop() only ended the threads: nothing was raised or reported yet
    zero, one = on_every_rank(lambda r: writers[r].join(), 2)
    assert isinstance(one, RuntimeError) and "cannot be written" in str(one)
    assert isinstance(zero, StorageTransferError) and "on rank 1" in str(zero)
    assert sorted(failed_on) == [0, 1]


def test_a_committed_write_leaves_no_stagesafe_thread_behind(tmp_path):
    uri, values = str(tmp_path / "h"), _values()
    writers = _writers(2, uri)
    before = _stagesafe_threads()

    def rank(r: int):
        writers[r].start(_request(values))
        return writers[r].join()

    on_every_rank(rank, 2)
    assert _bitwise(stagesafe.load_state_dict(uri), values) and stagesafe.verify(uri)
    deadline = time.monotonic() + 10
    while _stagesafe_threads() - before and time.monotonic() < deadline:  # a joined thread may take a moment to end
        time.sleep(0.01)
    assert _stagesafe_threads() - before == set()


def test_a_writes_state_is_read_from_what_its_threads_did(tmp_path):
    uri, values, gate = str(tmp_path / "h"), _values(), threading.Event()
    (writer,) = _writers(1, uri)
    assert writer.state is None
    writer.start(_request(values, fill=gate.wait))  # the private copies wait: still copying
    assert writer.state is WriteState.COPYING
    gate.set()
    deadline = time.monotonic() + 30
    while writer.state is not WriteState.COMMITTED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.state is WriteState.COMMITTED and stagesafe.read_manifest(uri)
    writer.join()
    assert writer.state is None


def test_a_failed_writes_state_is_failed_before_it_is_joined(tmp_path):
    (writer,) = _writers(1, str(tmp_path / "h"))
    values = _values()
    writer.start(_request({**values, "layer5.weight": Unwritable(values["layer5.weight"])}))
    deadline = time.monotonic() + 30
    while writer.state is not WriteState.FAILED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.state is WriteState.FAILED
    with pytest.raises(RuntimeError, match="cannot be written"):
        writer.join()


def test_a_writes_states_come_in_order_on_every_rank_and_committed_is_rank_zeros_word(tmp_path):
    """copying, writing, committed on both ranks, each held open by a gate: rank 1 is committed once it has
    read rank 0's word, before anyone joins."""
    uri, values = str(tmp_path / "h"), _values()
    writers = _writers(2, uri)
    copies = [threading.Event(), threading.Event()]
    for r in (0, 1):
        writers[r].start(_request(values, fill=copies[r].wait))
    assert [w.state for w in writers] == [WriteState.COPYING] * 2
    copies[0].set()
    _until(lambda: writers[0].state is not WriteState.COPYING)
    assert [w.state for w in writers] == [WriteState.WRITING, WriteState.COPYING]  # rank 0 waits for rank 1
    copies[1].set()
    _until(lambda: all(w.state is WriteState.COMMITTED for w in writers))
    assert [w.state for w in writers] == [WriteState.COMMITTED] * 2 and stagesafe.read_manifest(uri)
    commits = on_every_rank(lambda r: writers[r].join(), 2)
    assert commits[0].manifest["shards"] and commits[1] is None
    assert [w.state for w in writers] == [None, None]


def _until(condition, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)


def _transitions(resolve_copied, resolve_committed) -> set[tuple[str, str]]:
    """The state changes a write goes through when its futures resolve as the writer resolves them:
    ``copied`` first, then ``committed``."""
    copied, committed = concurrent.futures.Future(), concurrent.futures.Future()
    seen = [WriteState.of(copied, committed)]
    for resolve, future in ((resolve_copied, copied), (resolve_committed, committed)):
        resolve(future)
        seen.append(WriteState.of(copied, committed))
    return {(a.value, b.value) for a, b in zip(seen, seen[1:]) if a is not b}


def _code_transitions() -> set[tuple[str, str]]:
    ok = [lambda f: f.set_result(None)]
    failed = [lambda f: f.set_exception(OSError("disk full"))]
    found = set()
    for copied in ok + failed:
        for committed in ok + failed if copied is ok[0] else failed:  # a failed copy fails the write
            found |= _transitions(copied, committed)
    return found


def _diagram_in_the_docs() -> tuple[set[str], set[tuple[str, str]]]:
    """The states and arrows of docs/how-it-works.md's diagram of a write (its first code block after the
    heading: lines ``state ──> state  why``, and lines that carry on the text)."""
    with open(os.path.join(REPO, "docs", "how-it-works.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## The states of a write, and who joins it"):]
    block = section.split("```")[1]
    arrows = set()
    for line in block.strip("\n").splitlines():
        found = re.match(r"^(\w+) +──> +(\w+) ", line)
        assert found or line.startswith(" " * 20), f"a line of the diagram neither an arrow nor its text: {line!r}"
        if found:
            arrows.add((found[1], found[2]))
    return {s for arrow in arrows for s in arrow}, arrows


def test_the_docs_draw_exactly_the_states_and_steps_the_code_has():
    states, arrows = _diagram_in_the_docs()
    assert states == {s.value for s in WriteState}
    assert arrows == _code_transitions() == {
        ("copying", "writing"), ("copying", "failed"), ("writing", "committed"), ("writing", "failed"),
    }
    assert {s for s in WriteState if s.settled} == {WriteState.COMMITTED, WriteState.FAILED}
    assert not {a for a, _ in arrows} & {"committed", "failed"}  # nothing leaves a settled write


def test_a_copy_that_fails_fails_the_write_from_copying_on(tmp_path):
    (writer,) = _writers(1, str(tmp_path / "h"))
    gate = threading.Event()

    def fill() -> None:
        gate.wait(30)
        raise OSError("the device is gone")

    writer.start(_request(_values(), fill=fill))
    assert writer.state is WriteState.COPYING
    gate.set()
    assert isinstance(writer.copied.exception(30), OSError)
    assert writer.state is WriteState.FAILED
    with pytest.raises(OSError, match="the device is gone"):
        writer.join()
    assert not os.path.exists(tmp_path / "h" / "stagesafe.json")


def test_an_interrupted_lone_write_still_tells_the_other_ranks_and_the_interrupt_goes_on(tmp_path, caplog):
    writers = _writers(2, str(tmp_path / "h"), timeout=30)

    def interrupted() -> None:
        raise KeyboardInterrupt

    def rank(r: int):
        writers[r].write_alone(interrupted)
        return writers[r].join()

    zero, one = on_every_rank(rank, 2)
    assert isinstance(zero, KeyboardInterrupt) and one is None  # rank 1 did not wait out the timeout
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(m.startswith("stagesafe: rank 0 could not write the handoff") and m.endswith("interrupted")
               for m in errors), errors


def test_a_writes_two_futures_hold_its_private_copies_and_its_commit():
    """The futures are plain concurrent.futures, as a caller's own code would wait on them."""
    (writer,) = _writers(1, "memory://futures")
    writer.start(_request(_values()))
    copied, committed = writer.copied, writer.committed
    done, _ = concurrent.futures.wait([copied, committed], timeout=30)
    assert done == {copied, committed}
    assert copied.result() is None and committed.result().manifest["metadata"]["step"] == 1
    assert writer.join() is committed.result()
    assert writer.copied is None and writer.committed is None  # joined: no write pending


def test_a_rank_lets_go_of_its_private_copies_once_its_share_is_written(tmp_path):
    import gc
    import threading
    import weakref

    (writer,) = _writers(1, str(tmp_path / "h"))
    values = _values()
    expected = sum(t.nbytes for t in values.values())
    gate = threading.Event()
    writer.start(_request(values, fill=gate.wait))  # still copying: the copies are held
    assert writer.held_bytes() == expected
    refs = [weakref.ref(t) for t in values.values()]
    del values
    gate.set()
    writer.wait_let_go()  # the share is written: nothing of it is held, though the write is not joined yet
    gc.collect()
    assert writer.pending and writer.held_bytes() == 0 and all(ref() is None for ref in refs)
    writer.join()
    assert writer.held_bytes() == 0
