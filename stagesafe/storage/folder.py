"""A folder on any fsspec store: its file system, its path and the retry policy, and the storage calls every step
of a writer or reader makes. Nothing here knows what the files hold.

Every storage operation goes through :meth:`Folder.transfer`: tried again on
transient errors (:mod:`stagesafe.storage.retry`); after the last try, or on a refusal such as a missing bucket
or denied access, a ``StorageTransferError`` names the file, the URL and what to do. Every file is published
through :meth:`Folder.write`, atomically (:func:`stagesafe.storage.fs.write_atomic`). Also the probes
of a folder the strategy makes before any stage: :func:`check_writable`, :func:`write_probe`,
:func:`read_small`, :func:`remove_file`. :func:`each` runs a transfer over many shards a few at a time, and
stops the others at the first failure: the one parallel loop over a folder's files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec

from stagesafe.errors import InvalidArgumentError, StorageTransferError
from stagesafe.storage.fs import basename, is_local, join, resolve, url_of, write_atomic
from stagesafe.storage.retry import RetryPolicy, TransferAbandoned, call_with_retries
from stagesafe.storage.workers import Workers

__all__ = [
    "Folder",
    "check_retry",
    "check_workers",
    "check_writable",
    "each",
    "read_small",
    "remove_file",
    "write_probe",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

_LOCAL_WORKERS = 4  # on a local disk, at most the CPU count
_REMOTE_WORKERS = 4  # default shards in flight on a remote filesystem
_REMOVERS = 8  # files deleted at once


@dataclass(frozen=True)
class Folder:
    """The folder ``root`` on ``fs``, whose storage operations are tried as ``retry`` says."""

    fs: fsspec.AbstractFileSystem
    root: str
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    @classmethod
    def at(cls, uri: str, storage_options: dict[str, Any] | None = None, *, retry: Any = None) -> Folder:
        """The folder at ``uri`` (:func:`~stagesafe.storage.fs.resolve`), with ``retry`` checked (None: the default)."""
        fs, root = resolve(uri, storage_options)
        return cls(fs, root, check_retry(retry))

    def tried_once(self) -> Folder:
        """This folder, its operations tried once: for looks that a later step repeats anyway."""
        return dataclasses.replace(self, retry=RetryPolicy(attempts=1))

    @property
    def url(self) -> str:
        """The folder as messages name it (:func:`~stagesafe.storage.fs.url_of`)."""
        return url_of(self.fs, self.root)

    def path(self, name: str) -> str:
        """The path of the file ``name`` in this folder."""
        return join(self.root, name)

    def transfer(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        stop: threading.Event | None = None,
        hint: str = "",
        writing: bool = False,
    ) -> T:
        """``fn()``, a storage operation, tried again on transient errors; a refusal by the store named as ``what``.

        ``FileNotFoundError`` propagates from reads (callers know what a missing file means there); from a write
        (``writing``) it means the bucket is missing. ``stop``, once set, ends the retries (another transfer of
        the same operation failed); ``hint`` ends the message of a failure.
        """
        try:
            return call_with_retries(fn, policy=self.retry, what=what, hint=hint, stop=stop)
        except PermissionError as exc:
            verb = "write" if writing else "read"
            advice = (
                f"check that this user may {verb} there (the folder's permissions, a read-only or immutable file)"
                if is_local(self.fs)
                else f"check the credentials in storage_options (key/secret, profile, token) and that they may "
                f"{verb} there"
            )
            raise StorageTransferError(f"could not {what}: access denied ({exc}); {advice}{hint}") from exc
        except FileNotFoundError as exc:
            if not writing:
                raise
            raise StorageTransferError(
                f"could not {what}: the bucket or folder it goes into does not exist ({exc}); create it first, or "
                f"correct the URL{hint}"
            ) from exc
        except StorageTransferError:
            raise
        except OSError as exc:  # disk full, file too large, read-only file system, a file where a folder should be
            if not writing:
                raise
            raise StorageTransferError(f"could not {what}: {exc}{hint}") from exc

    def write(self, name: str, data: bytes | Iterable[bytes | memoryview]) -> None:
        """Publish ``data`` (bytes, or chunks streamed one at a time) as the file ``name``, atomically; one try
        (callers wrap it in :meth:`transfer`)."""
        write_atomic(self.fs, self.path(name), data)

    def remove(self, names: Iterable[str], *, empty_root: bool = False) -> None:
        """Delete the files ``names``, several at once (on an object store each delete is a round trip), then,
        with ``empty_root``, the folder itself if that left it empty. Best effort: a file left over is deleted
        by a later save once it is old."""
        paths = [self.path(n) for n in names]
        if paths:
            with Workers(min(len(paths), _REMOVERS), name="stagesafe-rm") as pool:
                list(pool.map(lambda path: _remove(self.fs, path), paths))
        if empty_root:
            try:
                if self.fs.isdir(self.root) and not self.fs.ls(self.root, detail=False):
                    self.fs.rmdir(self.root)
            except OSError:
                pass


def each(items: Sequence[str], fn: Callable[[str, threading.Event], T], workers: int) -> dict[str, T]:
    """``fn(item, stop)`` for every item, ``workers`` at a time; return the results in the items' order.

    Only ``workers`` calls run at once, so memory is bounded by what each one holds. The first failure sets
    ``stop`` (so that the others stop retrying) and cancels the calls not started; once the running ones are done,
    the failure of the earliest item is raised, as a loop over the items would have raised it.
    """
    stop = threading.Event()
    if workers == 1 or len(items) <= 1:
        return {item: fn(item, stop) for item in items}
    pool = Workers(min(workers, len(items)), name="stagesafe-transfer")
    try:
        futures = [pool.submit(fn, item, stop) for item in items]
        for future in concurrent.futures.as_completed(futures):
            if future.exception() is not None:
                break
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
    failures = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    if failures:  # the items start in order, so every item before a failed one has run
        raise next((e for e in failures if not isinstance(e, TransferAbandoned)), failures[0])
    return {item: future.result() for item, future in zip(items, futures)}


def check_retry(retry: Any) -> RetryPolicy:
    """``retry`` as given, the default policy for None; anything else is refused."""
    if retry is None:
        return RetryPolicy()
    if not isinstance(retry, RetryPolicy):
        raise InvalidArgumentError(
            f"retry={retry!r} must be a stagesafe.RetryPolicy, e.g. RetryPolicy(attempts=8, initial_delay=2)"
        )
    return retry


def check_workers(workers: Any, fs: fsspec.AbstractFileSystem) -> int:
    """Shards transferred at once: ``workers`` as given, or by default 4 on a remote filesystem and up to 4 on a
    local disk (shards hash at once, outside the GIL)."""
    if workers is None:
        return min(_LOCAL_WORKERS, os.cpu_count() or 1) if is_local(fs) else _REMOTE_WORKERS
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgumentError(f"workers={workers!r} must be a positive int: the shards transferred at once")
    return workers


def check_writable(
    uri: str,
    name: str,
    *,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    hint: str = "",
) -> None:
    """Fail now rather than after a stage: write and delete a small file ``name`` under ``uri`` (a path that
    cannot be created, missing credentials or permissions, no such bucket). Give a name that the folder's own
    cleanup removes, should it be left behind."""
    fs, root = resolve(uri, storage_options)
    write_probe(fs, root, name, b"{}", retry=retry, hint=hint)
    remove_file(fs, join(root, name))


def write_probe(
    fs: fsspec.AbstractFileSystem,
    root: str,
    name: str,
    data: bytes,
    *,
    retry: RetryPolicy | None = None,
    hint: str = "",
) -> None:
    """Write a small file ``name`` under ``root``, with the store's errors for a folder that cannot be written
    (``hint`` ends them: what the failure left as it was)."""
    folder = Folder(fs, root, check_retry(retry))
    folder.transfer(lambda: folder.write(name, data), what=f"write to {folder.url!r}", hint=hint, writing=True)


def read_small(fs: fsspec.AbstractFileSystem, path: str, *, limit: int = 4096) -> bytes | None:
    """The bytes of a small file, or None when it is missing, larger than ``limit`` or unreadable."""
    try:
        with fs.open(path, "rb") as f:
            data = f.read(limit + 1)
    except Exception:  # noqa: BLE001 - any storage client's error means: not seen
        return None
    return data if len(data) <= limit else None


def remove_file(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete one file, best effort (a leftover is deleted by a later save once it is old)."""
    _remove(fs, path)


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Best effort: the handoff is committed (or never was); a file left over is cleaned by the next save."""
    try:
        fs.rm_file(path)
    except (FileNotFoundError, NotADirectoryError):  # not there: a path under a regular file cannot be either
        pass
    except Exception as exc:  # noqa: BLE001 - any storage client's error (botocore's are not OSErrors)
        log.warning("stagesafe: could not delete stale file %s (%s); the next save retries", basename(path), exc)
