"""stagesafe's thread pool: daemon threads that Lightning's test suite can stop, and no thread after the work."""

from __future__ import annotations

import threading

import pytest

from stagesafe.handoff import digest
from stagesafe.storage.workers import Workers


def _alive(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_results_come_back_in_order_and_errors_reach_the_caller():
    with Workers(3, name="stagesafe-test-a") as pool:
        assert list(pool.map(lambda x: x * x, range(10))) == [x * x for x in range(10)]
        future = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            future.result()
        assert all(t.daemon for t in _alive("stagesafe-test-a"))
    assert _alive("stagesafe-test-a") == []  # joined on the way out
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(print)


def test_cancelled_work_never_runs():
    gate, ran = threading.Event(), []
    pool = Workers(1, name="stagesafe-test-b")
    first = pool.submit(gate.wait)
    later = [pool.submit(ran.append, i) for i in range(5)]
    threading.Timer(0.2, gate.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert first.result() is True and ran == [] and all(f.cancelled() for f in later)


def test_a_threads_stop_waits_for_its_owner_to_finish_and_leaves_it_dead():
    gate = threading.Event()
    pool = Workers(2, name="stagesafe-test-c")
    pool.submit(gate.wait)
    (thread,) = _alive("stagesafe-test-c")

    def owner_finishes() -> None:
        gate.set()
        pool.shutdown(wait=True)

    threading.Timer(0.2, owner_finishes).start()
    thread.stop()  # what Lightning's conftest calls on a daemon thread a test left running
    assert not thread.is_alive() and gate.is_set()


def test_hashing_threads_live_only_while_something_hashes():
    data = bytes(range(256)) * (64 * 1024)  # 16 MiB: four pieces, hashed on several threads
    with digest.Pipeline(digest.XXH3_TREE, workers=4) as hashing:
        hashing.add(data)
        hashing.add(data)
        assert len(_alive("stagesafe-hash_")) >= 1  # the operation's threads, kept from chunk to chunk
        expected = hashing.hexdigest()
    assert digest.hash_buffer(digest.XXH3_TREE, data + data, workers=4) == expected
    assert _alive("stagesafe-hash") == []  # neither the pipeline's thread nor the pool outlives its work
