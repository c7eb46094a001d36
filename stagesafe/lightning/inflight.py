"""Handoff writes still running in this job, so that nothing reads, or exits before, a half-done write.

A stage boundary returns as soon as the module holds its weights; the handoff's durable write goes on in a
thread on rank 0. Readers of the same URL (``load_state_dict``, ``restore``, ``verify``, ``read_manifest``)
wait for it first: on rank 0 by joining the thread, on the other ranks through the job's rendezvous store
(``torch.distributed``'s key-value store, not a collective, so any thread may wait at any time), where rank 0
posts each write's outcome. The interpreter waits for the thread at exit (it is not a daemon).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

from stagesafe.errors import DistributedStageError, HandoffNotReadyError

__all__ = ["next_key", "job_store", "wait_for_keys", "start", "start_share", "mark_elsewhere", "forget", "wait_for"]

log = logging.getLogger(__name__)

_KEY_TIMEOUT = 1800.0  # seconds: torch.distributed's own default timeout
_lock = threading.Lock()
_RUNNING: dict[str, "concurrent.futures.Future[Any]"] = {}  # url -> the write this process runs
_ELSEWHERE: dict[str, str] = {}  # url -> store key of the write another rank runs
_SERIAL: dict[str, int] = {}  # url -> writes started so far: the same count on every rank (they run in step)


def next_key(url: str) -> str:
    """The store key of the next write of ``url``: every rank computes the same one (they start writes in step)."""
    with _lock:
        _SERIAL[url] = _SERIAL.get(url, 0) + 1
        return f"stagesafe/handoff-write/{url}/{_SERIAL[url]}"


def job_store() -> Any:
    """The job's ``torch.distributed`` key-value store, or ``None`` outside a distributed job."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: other ranks get a clear error instead of waiting
        return None


def wait_for_keys(store: Any, keys: list[str], *, timeout: float = _KEY_TIMEOUT) -> None:
    """Poll until every key is set. Never the store's blocking ``wait``: the job shares one store connection
    across threads, and a thread blocked in it would stall the trainer's own use of the store (new process
    groups at the next engine), and with it the rank whose key we are waiting for."""
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no word from the other ranks after {timeout:.0f} s (keys {keys[:2]}...)")
        time.sleep(0.05)


def start(url: str, key: str, write: Callable[[], Any]) -> "concurrent.futures.Future[Any]":
    """Rank 0: run ``write`` (which commits the handoff) in a (non-daemon) thread, then post its outcome under
    ``key`` for the other ranks."""
    store = job_store()

    def post(error: BaseException | None) -> None:
        if store is None:
            return
        try:
            store.set(key, f"failed: {type(error).__name__}: {error}" if error is not None else "ok")
        except Exception as exc:  # noqa: BLE001 - the store is gone (job ending): nobody is waiting
            log.debug("stagesafe: could not post the outcome of %s: %s", key, exc)

    future = _in_thread(f"stagesafe-write {url}", write, then=post)
    with _lock:
        _RUNNING[url] = future
    future.add_done_callback(lambda f: _done(url, f))
    return future


def _in_thread(
    name: str, write: Callable[[], Any], *, then: Callable[[BaseException | None], None] | None = None
) -> "concurrent.futures.Future[Any]":
    """Run ``write`` in a non-daemon thread (the interpreter waits for it); its result or error goes to the
    returned future, never swallowed, and ``then(error)`` runs after it."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        error = None
        try:
            future.set_result(write())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever joins the future
            error = exc
            future.set_exception(exc)
        if then is not None:
            then(error)

    threading.Thread(target=run, name=name, daemon=False).start()
    return future


def _done(url: str, future: "concurrent.futures.Future[Any]") -> None:
    """A write that succeeded is over; one that failed stays until a boundary collects it (or exit reports it)."""
    if future.exception() is None:
        with _lock:
            if _RUNNING.get(url) is future:
                del _RUNNING[url]


def start_share(url: str, key: str, write: Callable[[], Any]) -> "concurrent.futures.Future[Any]":
    """Another rank: run ``write`` (this rank's share of the shards) in a (non-daemon) thread; readers here wait
    for rank 0's commit, posted under ``key``."""
    mark_elsewhere(url, key)
    return _in_thread(f"stagesafe-write-share {url}", write)  # a failure reaches rank 0 through the store


def mark_elsewhere(url: str, key: str) -> None:
    """Rank 0 is committing ``url``: readers here wait for the outcome it posts under ``key``, until :func:`forget`."""
    with _lock:
        _ELSEWHERE[url] = key


def forget(url: str) -> None:
    """The ranks have joined the write of ``url`` and its outcome is known everywhere."""
    with _lock:
        _ELSEWHERE.pop(url, None)
        future = _RUNNING.get(url)
        if future is not None and future.done():
            del _RUNNING[url]


def wait_for(url: str) -> None:
    """Block until the write of ``url`` that this job is running ends; its failure is left to the boundary
    that joins it on rank 0, and raised here on the other ranks (the handoff was not replaced)."""
    with _lock:
        future = _RUNNING.get(url)
        key = _ELSEWHERE.get(url)
    if future is not None:
        concurrent.futures.wait([future])
        return
    if key is None:
        return
    store = job_store()
    if store is None:
        raise HandoffNotReadyError(
            f"{url!r} is still being written by rank 0 of this job; call strategy.wait_for_handoff() on every rank "
            "before reading it, or pass wait_for_write=True to StageSafeDeepSpeedStrategy"
        )
    wait_for_keys(store, [key])
    outcome = store.get(key).decode()
    if outcome != "ok":
        raise DistributedStageError(
            f"writing the handoff {url!r} in the background failed on rank 0 ({outcome.removeprefix('failed: ')}); "
            "it still holds the previous weights, and the next stage writes it again"
        )


@atexit.register
def _report_failures_at_exit() -> None:
    """Runs after the interpreter has joined the writer threads: say loudly what was not written."""
    with _lock:
        running = list(_RUNNING.items())
    for url, future in running:
        exc = future.exception()
        if exc is not None:
            log.error("stagesafe: the handoff write to %s failed and nobody joined it: %s", url, exc)
