"""The thread pool every stagesafe operation uses: daemon threads that can be told to stop.

Work of a Trainer call may go on after the call returns (the background handoff write hashes and writes shards
on threads of its own). Lightning's test suite, and whoever follows its convention, calls ``stop()`` on every
daemon thread a test left running and then requires it to be dead; any other leftover thread fails the test.
``concurrent.futures`` pools start non-daemon threads without ``stop()``, so this pool's threads are daemons whose
``stop()`` waits for the pool's owner to shut it down (the operation finishing) and returns with the thread
dead. Threads start as work arrives, up to ``max_workers``.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["Workers"]

T = TypeVar("T")
_STOP_WAIT = 600.0  # seconds a thread's stop() waits for its pool's owner to finish (then it returns, alive)


class Workers:
    """``submit``, ``map`` and ``shutdown`` as in :class:`concurrent.futures.ThreadPoolExecutor`; use it as a
    context manager, which shuts it down (joining its threads) on the way out."""

    def __init__(self, max_workers: int, *, name: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max, self._name = max_workers, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[_WorkerThread] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError(f"the {self._name} pool is shut down: no new work")
            self._queue.put((future, fn, args, kwargs))
            if len(self._threads) < self._max:
                thread = _WorkerThread(self, f"{self._name}_{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
        return future

    def map(self, fn: Callable[[Any], T], items: Iterable[Any]) -> Iterator[T]:
        futures = [self.submit(fn, item) for item in items]
        return (future.result() for future in futures)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed.set()
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in self._threads:
                self._queue.put(None)
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(wait=True)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, args, kwargs, item  # nothing of a finished call stays alive while waiting


class _WorkerThread(threading.Thread):
    def __init__(self, pool: Workers, name: str) -> None:
        super().__init__(target=pool._run, name=name, daemon=True)
        self._pool = pool

    def stop(self) -> None:
        """Return once the pool's owner has shut it down and this thread has ended (at most ``_STOP_WAIT`` s)."""
        if self._pool._closed.wait(_STOP_WAIT):
            self.join(_STOP_WAIT)
