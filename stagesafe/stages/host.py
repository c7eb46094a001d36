"""Host memory that a stage's trained weights land in, made ready while the stage runs.

On an H200 host, copying a GPU tensor to fresh pageable memory runs at 1.4 GB/s per rank (page faults),
to resident pageable memory at 10 GB/s, and to page-locked memory at 54 GB/s, the bus's speed
(``benchmarks/profile_host_copy.py``). So the tensors a stage's end copies into are allocated, touched and
page-locked in place (``cudaHostRegister``) by a background thread during the stage, and unlocked by the
handoff writer once the Trainer call has returned: the end of a stage then pays for the copy alone.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import Any, Iterable, Mapping

import torch

from stagesafe.handoff.workers import Workers
from stagesafe.stages import page_lock

__all__ = ["HostBuffers", "HostPool"]

log = logging.getLogger(__name__)

_TOUCH_CHUNK = 64 << 20


class HostBuffers:
    """Host tensors for a stage's end: ``existing`` ones (written in place), ``fresh`` ones allocated here (a
    writer's private copies), and ``new`` ones allocated here to become module tensors (added to
    ``existing`` once ready).

    ``lock_on``: the CUDA device whose copies will fill them, or ``None`` (a CPU run: nothing to lock).
    Everything happens in a thread; :meth:`ready` joins it. Tensors allocated here have pages of their own and
    are all locked; an existing one is locked only where its pages hold nothing else
    (:mod:`~stagesafe.stages.page_lock`). Locked tensors are kept alive until :meth:`unlock`, which must come
    before the same memory is locked again.
    """

    def __init__(
        self,
        existing: Mapping[str, torch.Tensor],
        fresh: Mapping[str, tuple[torch.Size, torch.dtype]],
        *,
        new: Mapping[str, tuple[torch.Size, torch.dtype]] | None = None,
        lock_on: torch.device | None,
        go_on: threading.Event | None = None,
    ) -> None:
        self.existing = dict(existing)
        self._go_on = go_on  # cleared: the work waits (between pieces) until it is set again
        self._new = dict(new or {})
        self.fresh: dict[str, torch.Tensor] = {}
        self._locked: list[page_lock.PageRun] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._prepare, args=(dict(fresh), lock_on), name="stagesafe-host-buffers", daemon=True
        )
        self._thread.start()
        # dropped without unlock(): unlocked before the memory can go (not at exit: the process's end frees all)
        weakref.finalize(self, page_lock.unlock_all, self._locked).atexit = False

    def ready(self) -> "HostBuffers":
        self._thread.join()
        return self

    def unlock(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Unlock the storages of ``tensors`` (default: all that this object locked); they may be freed
        afterwards."""
        with self._lock:
            if tensors is None:
                page_lock.unlock_all(self._locked)
                return
            storages = {t.untyped_storage().data_ptr() for t in tensors}
            for run in [run for run in self._locked if run.storage in storages]:
                page_lock.unlock(run)
                self._locked.remove(run)

    def _prepare(self, fresh: dict[str, tuple[torch.Size, torch.dtype]], lock_on: torch.device | None) -> None:
        try:
            if lock_on is not None:
                torch.cuda.set_device(lock_on)  # before any CUDA call: no context on another rank's GPU
            allocated = {name: page_lock.empty(shape, dtype) for name, (shape, dtype) in fresh.items()}
            made = {name: page_lock.empty(shape, dtype) for name, (shape, dtype) in self._new.items()}
            _touch([*allocated.values(), *made.values()], self._go_on)
            self.fresh = allocated
            self.existing.update(made)
            if lock_on is not None:
                failed: dict[str, int] = {}
                for run in page_lock.page_runs([*self.existing.values(), *allocated.values()]):  # made ones too
                    if self._go_on is not None:
                        self._go_on.wait()
                    with self._lock:
                        reason = page_lock.lock(run)
                        if reason is None:
                            self._locked.append(run)
                        elif reason != page_lock.LOCKED_ELSEWHERE:  # locked whole by another: copies are right
                            failed[reason] = failed.get(reason, 0) + len(run.tensors)
                if failed:
                    log.warning(
                        "stagesafe: could not page-lock %d host tensor(s) (%s); their copies will be slower",
                        sum(failed.values()),
                        "; ".join(f"{n} x {reason}" for reason, n in failed.items()),
                    )
        except Exception as exc:  # noqa: BLE001 - only speed is at stake: copies fall back to plain memory
            log.warning("stagesafe: preparing host memory for the end of the stage failed (%s); continuing", exc)


class HostPool:
    """Host tensors of given shapes and dtypes, made ready (allocated, touched, page-locked) in the background
    while a stage runs, then taken one by one by shape and dtype: where a training stage's end copies the
    engine's optimizer state, which outlives the engine in host memory. More can be asked for later
    (:meth:`add`), e.g. once the optimizer has made state that could not be foreseen.

    Tensors still in the pool at :meth:`close` are unlocked and dropped; the taken ones stay locked until
    their owner (given to :meth:`close`) is garbage: memory is unlocked before it is freed.
    """

    def __init__(self, specs: Iterable[tuple[torch.Size, torch.dtype]], *, lock_on: torch.device | None) -> None:
        self._lock_on = lock_on
        self._batches: list[HostBuffers] = []
        self._asked: collections.Counter[tuple[tuple[int, ...], torch.dtype]] = collections.Counter()
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] | None = None
        self._taken: list[torch.Tensor] = []
        self._closed = False
        self._go_on = threading.Event()
        self._go_on.set()
        self.add(specs)

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
            for batch in self.ready()._batches:
                for tensor in batch.fresh.values():
                    self._free.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)
                batch.fresh = {}
        free = self._free.get((tuple(shape), dtype))
        if not free:
            return None
        tensor = free.pop()
        self._taken.append(tensor)
        return tensor

    def close(self, owner: Any | None) -> None:
        """Unlock what was not taken; the taken tensors stay locked while ``owner`` lives (None: unlock all)."""
        if self._closed:
            return
        self._closed = True
        self.ready()
        untaken = [t for free in (self._free or {}).values() for t in free]
        untaken += [t for batch in self._batches for t in batch.fresh.values()]
        for batch in self._batches:
            batch.fresh = {}
        self._free = None
        taken, self._taken = self._taken, []
        _unlock(self._batches, untaken)
        if owner is None:
            _unlock(self._batches, taken)
        elif taken:
            weakref.finalize(owner, _unlock, list(self._batches), taken).atexit = False  # the process's end frees all


def _unlock(batches: list[HostBuffers], tensors: list[torch.Tensor]) -> None:
    for batch in batches:  # each unlocks those it locked
        batch.unlock(tensors)


def _touch(tensors: list[torch.Tensor], go_on: threading.Event | None = None) -> None:
    """Fault the pages in from several threads: first touch, not the copy, is what makes fresh memory slow.
    ``go_on``: cleared, the threads wait before their next piece."""
    pieces = []
    for tensor in tensors:
        flat = tensor.view(-1).view(torch.uint8) if tensor.numel() else None
        if flat is None:
            continue
        pieces.extend(flat[i : i + _TOUCH_CHUNK] for i in range(0, flat.numel(), _TOUCH_CHUNK))
    with Workers(8, name="stagesafe-touch") as pool:
        list(pool.map(lambda piece: (go_on.wait() if go_on is not None else None, piece.zero_()), pieces))
