"""Host memory that a stage's trained weights land in, made ready while the stage runs.

On an H200 host, copying a GPU tensor to fresh pageable memory runs at 1.4 GB/s per rank (page faults),
to resident pageable memory at 10 GB/s, and to page-locked memory at 54 GB/s, the bus's speed
(``benchmarks/profile_host_copy.py``). So the tensors a stage's end copies into are allocated, touched and
page-locked in place (``cudaHostRegister``) by a background thread during the stage, and the module's are
unlocked by the handoff writer once the Trainer call has returned: the end of a stage then pays for the copy
alone. Memory made here is in pages of its own (:func:`~stagesafe.stages.page_lock.empty`) and is unlocked, if
it still is, before it is freed: whoever holds it last lets it go.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import gc
import logging
import threading
import weakref
from typing import Callable, Iterable, Mapping

import torch

from stagesafe.storage.workers import Workers
from stagesafe.stages import page_lock

__all__ = ["HostBuffers", "HostPool", "give_back_freed_memory"]

log = logging.getLogger(__name__)

_TOUCH_CHUNK = 64 << 20
_THREADS = 8

Specs = Mapping[str, tuple[torch.Size, torch.dtype]]


class HostBuffers:
    """Host tensors for a stage's end, made ready in a thread (:meth:`ready` joins it):

    - ``existing``: tensors the end writes in place (the module's own), page-locked where their pages hold
      nothing else (:mod:`~stagesafe.stages.page_lock`) and unlocked by :meth:`unlock`, since they outlive this;
    - ``swap``: the module's tensors whose pages are not their own (the C allocator's, on a GPU): each is copied into
      pages of its own, which take its place in ``existing`` and, through ``replace(name, old, new)``, wherever
      the caller holds it: one at a time, so that each old tensor can go as its copy comes (a module is never
      held twice);
    - ``new``: tensors made here to become the module's (added to ``existing``);
    - ``fresh``: tensors made here for a copy of their own (a writer's private copies, a pool's): locked, and
      unlocked only as they are freed, by whoever holds them last.

    ``lock_on``: the CUDA device whose copies will fill them, or ``None`` (a CPU run: nothing to lock, nothing
    to swap). ``go_on``, cleared: the work waits between pieces until it is set again. ``after``: what the
    thread waits for before it allocates anything (memory someone else lets go of first).
    """

    def __init__(
        self,
        existing: Mapping[str, torch.Tensor],
        fresh: Specs,
        *,
        new: Specs | None = None,
        swap: Mapping[str, torch.Tensor] | None = None,
        replace: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None,
        lock_on: torch.device | None,
        go_on: threading.Event | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.existing = dict(existing)
        self._after = after
        self._go_on = go_on
        self._new = dict(new or {})
        self._swap = dict(swap or {})
        self._replace = replace
        self._stop = threading.Event()
        self.fresh: dict[str, torch.Tensor] = {}
        self.swapped: set[str] = set()
        self._locked: list[page_lock.PageRun] = []  # runs of ``existing`` locked here
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._prepare, args=(dict(fresh), lock_on), name="stagesafe-host-buffers", daemon=True
        )
        self._thread.start()
        # dropped without unlock(): what it locked in place is unlocked (not at exit: the process's end frees all)
        weakref.finalize(self, page_lock.unlock_all, self._locked).atexit = False

    def ready(self) -> "HostBuffers":
        self._thread.join()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Whether making the memory ready is over within ``timeout`` seconds (a hold is not ended)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> "HostBuffers":
        """Stop swapping and wait for the thread: a tensor not moved yet stays where it is, in ``existing``
        (the end copies into it as pageable memory: slower, but no second copy of it)."""
        self._stop.set()
        self.ready()
        for name, tensor in list(self._swap.items()):
            self.existing.setdefault(name, tensor)
        return self

    def unlock(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Unlock the storages of ``tensors`` among those locked in place (default: all of them)."""
        with self._lock:
            if tensors is None:
                page_lock.unlock_all(self._locked)
                return
            storages = {t.untyped_storage().data_ptr() for t in tensors}
            for run in [run for run in self._locked if run.storage in storages]:
                page_lock.unlock(run)
                self._locked.remove(run)

    def _prepare(self, fresh: Specs, lock_on: torch.device | None) -> None:
        try:
            if lock_on is not None:
                torch.cuda.set_device(lock_on)  # before any CUDA call: no context on another rank's GPU
            failed: dict[str, int] = {}
            if self._after is not None:
                self._after()
            if lock_on is not None:  # the module's own first: the end copies into them
                self._lock_runs(self.existing.values(), failed, track=True)
            self._swap_into_own_pages(lock_on, failed)
            made = {name: page_lock.empty(shape, dtype) for name, (shape, dtype) in self._new.items()}
            allocated = {name: page_lock.empty(shape, dtype) for name, (shape, dtype) in fresh.items()}
            _touch([*made.values(), *allocated.values()], self._go_on)
            self.existing.update(made)
            if lock_on is not None:
                self._lock_runs(made.values(), failed, track=True)
                self._lock_runs(allocated.values(), failed, track=False)
            self.fresh = allocated
            if failed:
                log.warning(
                    "stagesafe: could not page-lock %d host tensor(s) (%s); their copies will be slower",
                    sum(failed.values()),
                    "; ".join(f"{n} x {reason}" for reason, n in failed.items()),
                )
        except Exception as exc:  # noqa: BLE001 - only speed is at stake: copies fall back to plain memory
            log.warning("stagesafe: preparing host memory for the end of the stage failed (%s); continuing", exc)

    def _lock_runs(self, tensors: Iterable[torch.Tensor], failed: dict[str, int], *, track: bool) -> None:
        for run in page_lock.page_runs(list(tensors)):
            if self._go_on is not None:
                self._go_on.wait()
            with self._lock:
                reason = page_lock.lock(run)
                if reason is None and track:
                    self._locked.append(run)
                elif reason is not None and reason != page_lock.LOCKED_ELSEWHERE:  # locked whole by another
                    failed[reason] = failed.get(reason, 0) + len(run.tensors)

    def _swap_into_own_pages(self, lock_on: torch.device | None, failed: dict[str, int]) -> None:
        """Each tensor of ``swap`` (tied names: once) copied into pages of its own, then locked, and put in its
        place; largest first, so that a stage that ends early has swapped most of the bytes."""
        by_memory: dict[tuple, list[str]] = {}
        for name, tensor in self._swap.items():
            by_memory.setdefault(_memory_key(tensor), []).append(name)
        order = sorted(by_memory.values(), key=lambda names: -self._swap[names[0]].nbytes)
        with Workers(_THREADS, name="stagesafe-swap") as pool:
            for names in order:
                if self._stop.is_set():
                    return
                old = self._swap[names[0]]
                new = page_lock.empty(old.shape, old.dtype)
                _copy(new, old, pool, self._go_on)
                if lock_on is not None:
                    self._lock_runs([new], failed, track=True)
                for name in names:
                    self.existing[name] = new
                    self.swapped.add(name)
                    if self._replace is not None:
                        self._replace(name, self._swap[name], new)
                    del self._swap[name]
                del old


class HostPool:
    """Host tensors of given shapes and dtypes, made ready (allocated, touched, page-locked) in the background
    while a stage runs, then taken one by one by shape and dtype: where a training stage's end copies the
    engine's optimizer state, which outlives the engine in host memory. More can be asked for later
    (:meth:`add`), e.g. once the optimizer has made state that could not be foreseen; ready tensors can be
    given to it (:meth:`adopt`: the last fit's kept state, whose memory the next one's takes over).

    Tensors still in the pool at :meth:`close` are dropped; every tensor is unlocked as it is freed.
    """

    def __init__(self, specs: Iterable[tuple[torch.Size, torch.dtype]], *, lock_on: torch.device | None) -> None:
        self._lock_on = lock_on
        self._batches: list[HostBuffers] = []
        self._asked: collections.Counter[tuple[tuple[int, ...], torch.dtype]] = collections.Counter()
        self._adopted: list[torch.Tensor] = []
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] | None = None
        self._closed = False
        self._go_on = threading.Event()
        self._go_on.set()
        self.add(specs)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds or is making ready, adopted ones included."""
        return sum(_nbytes(shape, dtype) * n for (shape, dtype), n in self._asked.items())

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Take ready host tensors (touched, locked or not) as the pool's own: :meth:`add` asks only for what
        they do not cover."""
        if self._closed or self._free is not None:
            return
        for tensor in tensors:
            if tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.numel():
                self._adopted.append(tensor)
                self._asked[(tuple(tensor.shape), tensor.dtype)] += 1

    def add(self, specs: Iterable[tuple[torch.Size, torch.dtype]]) -> None:
        """Start making ready those of ``specs`` the pool does not hold yet (counting repeats)."""
        wanted = collections.Counter((tuple(shape), dtype) for shape, dtype in specs)
        missing = list((wanted - self._asked).elements())
        if self._closed or self._free is not None or not missing:
            return
        self._asked.update(missing)
        fresh = {str(i): (torch.Size(shape), dtype) for i, (shape, dtype) in enumerate(missing)}
        self._batches.append(HostBuffers({}, fresh, lock_on=self._lock_on, go_on=self._go_on))

    def hold(self) -> None:
        """Making the pool ready waits (between pieces) from now until :meth:`release`, :meth:`ready` or
        :meth:`close`: a stage's end copies its weights off the device meanwhile, which making 17 GB ready beside
        them slowed from 0.20 to 1.33 s on an H200 host, and page-locking holds the CUDA driver's lock, which the
        rest of the call's CUDA calls would wait for."""
        self._go_on.clear()

    def release(self) -> None:
        """Let making the pool ready go on after :meth:`hold`."""
        self._go_on.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether making the pool ready is over within ``timeout`` seconds each batch (unlike :meth:`ready`,
        a hold is not ended)."""
        return all(batch.wait(timeout) for batch in self._batches)

    @property
    def made_ready(self) -> int:
        """Bytes of the tensors made ready so far and not yet handed out (adopted ones not counted)."""
        return sum(t.nbytes for batch in self._batches for t in batch.fresh.values())

    def ready(self) -> "HostPool":
        """Wait until the tensors are made ready (or making them failed: then the copies allocate their own)."""
        self.release()  # never wait for work that is held
        for batch in self._batches:
            batch.ready()
        return self

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """A ready tensor of this shape and dtype, or None when the pool has none left."""
        if self._closed:
            return None
        if self._free is None:
            self._free = {}
            ready = [*self._adopted, *(t for batch in self.ready()._batches for t in batch.fresh.values())]
            for tensor in ready:
                self._free.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)
            self._adopted = []
            for batch in self._batches:
                batch.fresh = {}
        free = self._free.get((tuple(shape), dtype))
        return free.pop() if free else None

    def close(self) -> None:
        """Drop what was not taken (the taken tensors are their holders')."""
        if self._closed:
            return
        self._closed = True
        self.ready()
        self._free, self._adopted = None, []
        for batch in self._batches:
            batch.fresh = {}


def give_back_freed_memory() -> None:
    """Return the C heap's free memory to the kernel (glibc's ``malloc_trim``), once a stage's engine is gone:
    an engine on the CPU frees gigabytes in pieces of a few MiB, which glibc keeps in its heaps, and the next
    stage, asking for other sizes, cannot always reuse them (a later fit then peaked a gigabyte above the first
    on the CPU). The engine holds reference cycles: they are collected first. No-op where there is no glibc."""
    gc.collect()
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _memory_key(tensor: torch.Tensor) -> tuple:
    """The same for every name of a tied parameter: the memory a tensor views."""
    if not tensor.numel():
        return (id(tensor),)
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()


def _copy(dest: torch.Tensor, source: torch.Tensor, pool: Workers, go_on: threading.Event | None) -> None:
    """``dest`` (fresh pages) takes ``source``'s values, in pieces on several threads: each first touch costs
    a page fault, which one thread alone would pay for at a fraction of the memory's speed."""
    flat_dest, flat_source = dest.view(-1).view(torch.uint8), source.contiguous().view(-1).view(torch.uint8)
    step = _TOUCH_CHUNK
    pieces = [(flat_dest[i : i + step], flat_source[i : i + step]) for i in range(0, flat_dest.numel(), step)]
    list(pool.map(lambda pair: (go_on.wait() if go_on is not None else None, pair[0].copy_(pair[1])), pieces))


def _touch(tensors: list[torch.Tensor], go_on: threading.Event | None = None) -> None:
    """Fault the pages in from several threads: first touch, not the copy, is what makes fresh memory slow.
    ``go_on``: cleared, the threads wait before their next piece."""
    pieces = []
    for tensor in tensors:
        flat = tensor.view(-1).view(torch.uint8) if tensor.numel() else None
        if flat is None:
            continue
        pieces.extend(flat[i : i + _TOUCH_CHUNK] for i in range(0, flat.numel(), _TOUCH_CHUNK))
    with Workers(_THREADS, name="stagesafe-touch") as pool:
        list(pool.map(lambda piece: (go_on.wait() if go_on is not None else None, piece.zero_()), pieces))
