"""Shard digests: the hashes a manifest may record for its shards, and hashing them at memory speed.

A handoff's manifest names one digest for all its shards. Three are known:

- ``xxh3-128-tree`` (what new handoffs record): XXH3-128 of each 4 MiB piece of the file, then XXH3-128 of those
  16-byte digests followed by the file's length (8 bytes, little-endian). XXH3 runs at memory speed on one core,
  and the pieces are hashed on as many threads as there are cores, so checking every byte of a shard costs
  about what reading it does. It detects corruption (a flipped bit, a torn or mixed-up write), not tampering.
- ``blake3``: the standard BLAKE3-256 of the file (what ``b3sum`` prints), hashed on all cores; cryptographic,
  about four times slower per core than XXH3.
- ``sha256``: what every handoff recorded before (format ``stagesafe/1``); still read and verified.

None of them is a signature: whoever can write the shards can write the manifest too.

No torch and no fsspec here (the hash libraries are imported when first used), so that the format's pure logic
and the torch-free CLI can name and check digests. Hashing works on any buffer and on any file object with
``readinto``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any, Protocol

from stagesafe.errors import InvalidArgumentError
from stagesafe.storage.workers import Workers

__all__ = [
    "BLAKE3",
    "DEFAULT",
    "LEGACY",
    "NAMES",
    "SHA256",
    "XXH3_TREE",
    "Hasher",
    "Pipeline",
    "check_name",
    "hash_buffer",
    "hash_file",
    "is_hexdigest",
    "new",
    "read_hashed",
    "threads",
]

SHA256 = "sha256"
BLAKE3 = "blake3"
XXH3_TREE = "xxh3-128-tree"
NAMES = (XXH3_TREE, BLAKE3, SHA256)
DEFAULT = XXH3_TREE  # chosen by measurement: docs/performance.md, benchmarks/bench_load.py
LEGACY = SHA256  # what a manifest of format stagesafe/1 records
LEAF = 4 * 1024 * 1024  # xxh3-128-tree's piece size: part of the format, never to change under this name
CHUNK = 32 * 1024 * 1024  # bytes read at a time by read_hashed and hash_file: several pieces, hashed in parallel

_HEX_LENGTH = {SHA256: 64, BLAKE3: 64, XXH3_TREE: 32}
_HEX = frozenset("0123456789abcdef")


class Hasher(Protocol):
    """An incremental digest: ``update`` returns once it is done with the bytes it was given (the caller may
    reuse them), having hashed them on as many threads as the digest can use."""

    name: str

    def update(self, data: Any) -> None: ...

    def hexdigest(self) -> str: ...


def check_name(name: Any) -> str:
    """``name`` if it is a digest this stagesafe knows, else ``InvalidArgumentError`` saying which are."""
    if not isinstance(name, str) or name not in NAMES:
        raise InvalidArgumentError(f"digest={name!r} is not one stagesafe knows; pass one of {', '.join(NAMES)}")
    return name


def is_hexdigest(name: str, value: Any) -> bool:
    """Whether ``value`` has the form of a ``name`` digest: lower-case hex of the right length."""
    return isinstance(value, str) and len(value) == _HEX_LENGTH[name] and _HEX.issuperset(value)


def threads() -> int:
    """The CPUs this process may run on: as many hashing threads as help."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def new(name: str, *, workers: int | None = None) -> Hasher:
    """An incremental ``name`` hasher using up to ``workers`` threads (default: :func:`threads`)."""
    check_name(name)
    workers = threads() if workers is None else workers
    if name == XXH3_TREE:
        return _Xxh3Tree(workers)
    if name == BLAKE3:
        return _Blake3(workers)
    return _Sha256()


def hash_buffer(name: str, data: Any, *, workers: int | None = None) -> str:
    """The ``name`` digest of a whole buffer (bytes, a memoryview, a mapped file), on up to ``workers`` threads."""
    with _hashing_threads.lease():
        hasher = new(name, workers=workers)
        hasher.update(data)
        return hasher.hexdigest()


class Pipeline:
    """Hashes a stream's chunks in order on a thread of its own, one chunk behind whoever produces them: the
    producer reads (or writes) the next chunk while this one is hashed. ``add`` returns once the chunk before
    is hashed, so only the last chunk given must stay unchanged; :meth:`hexdigest` waits for it.

    Use as a context manager: on the way out, even on an error, the hashing thread is done with every chunk."""

    def __init__(self, name: str, *, workers: int | None = None) -> None:
        self._hasher = new(name, workers=workers)
        self._lease = _hashing_threads.lease()  # the hashing threads stay up from chunk to chunk
        self._lease.__enter__()
        self._thread = Workers(1, name="stagesafe-hash-stream")
        self._pending: concurrent.futures.Future | None = None

    def add(self, chunk: Any) -> None:
        self._wait()
        self._pending = self._thread.submit(self._hasher.update, chunk)

    def hexdigest(self) -> str:
        self._wait()
        return self._hasher.hexdigest()

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._thread.shutdown(wait=True)
        finally:
            self._lease.__exit__(None, None, None)


def read_hashed(f: IO[bytes], buffer: Any, name: str, *, chunk: int = CHUNK) -> tuple[int, str]:
    """Fill ``buffer`` (writable, e.g. a ``bytearray``) from the file object ``f`` until it is full or the file
    ends, hashing each chunk while the next one is read; return the bytes read and their ``name`` digest."""
    view = memoryview(buffer).cast("B")
    done = 0
    with Pipeline(name) as hashing:
        while done < len(view):
            n = f.readinto(view[done : done + chunk])
            if not n:
                break
            hashing.add(view[done : done + n])
            done += n
        return done, hashing.hexdigest()


def hash_file(
    f: IO[bytes],
    limit: int,
    name: str,
    *,
    head: bytes = b"",
    chunk: int = CHUNK,
    on_read: Callable[[int], None] | None = None,
) -> tuple[int, str]:
    """The ``name`` digest of ``head`` (bytes already read from ``f``) followed by at most ``limit`` more bytes of
    the file object ``f``, and how many more there were. Memory stays at two chunks whatever the size: one is
    read while the other is hashed. ``on_read(n)``: called as each chunk is read (progress)."""
    buffers = (bytearray(min(chunk, limit)), bytearray(min(chunk, limit)))
    done = 0
    with Pipeline(name) as hashing:
        if head:
            hashing.add(head)
        for turn in _alternate():
            if done >= limit:
                break
            view = memoryview(buffers[turn])[: min(chunk, limit - done)]
            n = f.readinto(view)  # the other buffer is being hashed meanwhile; add() waits before reusing it
            if not n:
                break
            hashing.add(view[:n])
            done += n
            if on_read is not None:
                on_read(n)
        return done, hashing.hexdigest()


def _alternate() -> Iterator[int]:
    while True:
        yield 0
        yield 1


class _Sha256:
    name = SHA256

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, data: Any) -> None:
        self._hash.update(data)  # one thread: sha256 is a chain; hashlib releases the GIL

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class _Blake3:
    name = BLAKE3

    def __init__(self, workers: int) -> None:
        from blake3 import blake3

        self._hash = blake3(max_threads=blake3.AUTO if workers > 1 else 1)  # its own tree, split by its own pool

    def update(self, data: Any) -> None:
        self._hash.update(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class _Xxh3Tree:
    """XXH3-128 of every :data:`LEAF` bytes of the input, then of those digests and the input's length. Whole
    pieces inside one update are hashed in parallel; a piece split across updates is hashed as it comes."""

    name = XXH3_TREE

    def __init__(self, workers: int, *, leaf: int = LEAF) -> None:
        import xxhash

        self._xxh3_128 = xxhash.xxh3_128
        self._workers, self._leaf = workers, leaf
        self._digests: list[bytes] = []
        self._partial = xxhash.xxh3_128()  # the piece under way, which the next update continues
        self._filled = 0
        self._length = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._length += len(view)
        if self._filled:
            head = view[: self._leaf - self._filled]
            self._partial.update(head)
            self._filled += len(head)
            view = view[len(head) :]
            if self._filled == self._leaf:
                self._digests.append(self._partial.digest())
                self._partial.reset()
                self._filled = 0
        whole = len(view) // self._leaf * self._leaf
        if whole:
            self._digests.extend(_pieces_hashed(self._xxh3_128, view[:whole], self._leaf, self._workers))
        if whole < len(view):
            self._partial.update(view[whole:])
            self._filled = len(view) - whole

    def hexdigest(self) -> str:
        last = [self._partial.digest()] if self._filled else []
        root = b"".join(self._digests + last) + self._length.to_bytes(8, "little")
        return self._xxh3_128(root).hexdigest()


def _pieces_hashed(xxh3_128: Any, view: memoryview, leaf: int, workers: int) -> list[bytes]:
    """The digests of the consecutive ``leaf``-byte pieces of ``view``, in order, hashed by up to ``workers``
    threads of the shared pool, each taking a run of consecutive pieces (few tasks, each long)."""
    count = len(view) // leaf
    runs = min(workers, count)
    if runs <= 1:
        return [xxh3_128(view[i * leaf : (i + 1) * leaf]).digest() for i in range(count)]

    def run(first: int, last: int) -> list[bytes]:
        return [xxh3_128(view[i * leaf : (i + 1) * leaf]).digest() for i in range(first, last)]

    bounds = [count * k // runs for k in range(runs + 1)]
    with _hashing_threads.lease() as pool:
        futures = [pool.submit(run, bounds[k], bounds[k + 1]) for k in range(1, runs)]
        digests = run(bounds[0], bounds[1])  # the caller's thread takes the first run itself
        for future in futures:
            digests.extend(future.result())
    return digests


class _HashingThreads:
    """One thread per CPU, shared by the hashing operations running at once (so that shards hashed together
    share the cores instead of each starting threads of its own), and owned by them: the first lease starts
    the threads, the last one to end joins them, so none outlives the work. A forked child starts its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: Workers | None = None
        self._users = 0
        self._pid = os.getpid()

    @contextlib.contextmanager
    def lease(self) -> Iterator[Workers]:
        with self._lock:
            if self._pid != os.getpid():  # threads do not fork: the parent's pool is not ours
                self._pool, self._users, self._pid = None, 0, os.getpid()
            if self._pool is None:
                self._pool = Workers(threads(), name="stagesafe-hash")
            self._users += 1
            pool = self._pool
        try:
            yield pool
        finally:
            with self._lock:
                self._users -= 1
                idle = self._pool if self._users == 0 and self._pool is pool else None
                if idle is not None:
                    self._pool = None
            if idle is not None:
                idle.shutdown(wait=True)


_hashing_threads = _HashingThreads()
