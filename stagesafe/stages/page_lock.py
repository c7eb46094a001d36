"""Page-locking host tensors in place, only where every byte of the locked pages belongs to them.

CUDA copies into page-locked memory at the bus's speed and into pageable memory at a fifth of it (H200 host:
54 against 10 GB/s). ``cudaHostRegister`` locks whole pages, and CUDA refuses a copy whose host bytes are partly
locked and partly not ("invalid argument", ``cudaErrorInvalidValue``). So a page that also holds bytes of
another allocation must never be locked: that allocation's copies to or from any GPU would fail, whoever makes
them. So only storages allocated here (:func:`empty`, an anonymous mapping of their own, whatever their size) are
ever locked. Storages of the C allocator stay pageable whatever their size: glibc maps a block of 32 MiB or more
on its own only when no free block of the heap can hold it, and in a long process one often can (a 40 MiB
tensor carved out of freed heap memory shares its first and last pages with its neighbours).

Each storage is locked once per process (a registry): a storage locked elsewhere is wholly locked already, so
its copies are right.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import torch

__all__ = ["LOCKED_ELSEWHERE", "PageRun", "empty", "lock", "lockable", "locked_ranges", "own_mappings", "page_runs",
           "unlock", "unlock_all"]

PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels
_MADV_HUGEPAGE = 14
LOCKED_ELSEWHERE = "already page-locked by this process"
_REGISTER_FLAGS = 0  # cudaHostRegisterDefault: for this device's context, the one its copies run in

log = logging.getLogger(__name__)

_registry_lock = threading.RLock()  # a finalizer may free pages during a collection in a thread holding it
_locked: dict[int, tuple[int, int]] = {}  # start -> (end, CUDA device) of every run this process has locked
_own: dict[int, int] = {}  # start -> end of every live mapping made by empty()
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass
class PageRun:
    """The whole pages ``[start, end)`` of one storage, which hold nothing else; ``tensors`` (views of it) are
    kept alive while it is locked."""

    start: int
    end: int
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def storage(self) -> int:
        """The address of the storage whose pages these are."""
        return self.tensors[0].untyped_storage().data_ptr()


def empty(shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor in pages of its own (an anonymous mapping), so that it can be page-locked
    whatever its size. The pages go with the last view of them, unlocked first if they are still locked.

    A mapping of 2 MiB or more starts on a 2 MiB boundary and asks for transparent huge pages
    (``MADV_HUGEPAGE``): first touching fresh memory, not copying into it, is what makes it slow, and a huge page
    is one fault where small pages are 512 (the kernel falls back to small pages where it has no huge ones)."""
    shape = tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    length = -(-nbytes // PAGE) * PAGE
    start = _map(length)
    pages = (ctypes.c_ubyte * length).from_address(start)
    with _registry_lock:
        _own[start] = start + length
    # once the tensor's storage lets go of them; never at exit, where code may still read them (the end frees all)
    weakref.finalize(pages, _release, start, length).atexit = False
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def _map(length: int) -> int:
    """``length`` bytes of fresh anonymous memory; from 2 MiB on, aligned to 2 MiB and advised huge pages."""
    huge = length >= HUGE_PAGE
    asked = length + HUGE_PAGE if huge else length
    start = _libc.mmap(None, asked, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if start in (None, _MAP_FAILED):
        raise MemoryError(f"could not map {length} bytes of host memory: {os.strerror(ctypes.get_errno())}")
    if huge:  # keep the aligned part only
        aligned = -(-start // HUGE_PAGE) * HUGE_PAGE
        if aligned > start:
            _libc.munmap(start, aligned - start)
        if start + asked > aligned + length:
            _libc.munmap(aligned + length, start + asked - aligned - length)
        start = aligned
        _libc.madvise(start, length, _MADV_HUGEPAGE)  # advice only: an error leaves small pages, which work too
    return start


def _release(start: int, length: int) -> None:
    with _registry_lock:
        _own.pop(start, None)
        locked = _locked.pop(start, None)
        if locked is not None:  # its owner never unlocked it: CUDA must forget the pages before they go
            _unregister(start, locked[1])
    _libc.munmap(start, length)


def _own_pages(ptr: int, nbytes: int) -> bool:
    """Whether a storage's pages hold its bytes alone: those of a mapping made by :func:`empty`."""
    with _registry_lock:
        end = _own.get(ptr)  # a storage of empty() starts where its mapping does
        return end is not None and ptr + nbytes <= end


def lockable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage can be page-locked: on the CPU, not pinned already, not empty, and in pages
    of its own (made by :func:`empty`)."""
    if tensor.device.type != "cpu" or tensor.is_pinned():
        return False
    storage = tensor.untyped_storage()
    return storage.nbytes() > 0 and _own_pages(storage.data_ptr(), storage.nbytes())


def page_runs(tensors: Iterable[torch.Tensor]) -> list[PageRun]:
    """The storages of the :func:`lockable` ``tensors``, each as one run: its mapping's pages, in address order."""
    runs: dict[int, PageRun] = {}
    for tensor in tensors:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in runs and tensor.device.type == "cpu":
            runs[ptr].tensors.append(tensor)
        elif lockable(tensor):
            with _registry_lock:
                runs[ptr] = PageRun(ptr, _own[ptr], [tensor])  # a lockable storage starts its mapping
    return [runs[ptr] for ptr in sorted(runs)]


def own_mappings() -> list[tuple[int, int]]:
    """``(start, end)`` of every live mapping :func:`empty` made: the host memory stagesafe holds in pages of its
    own (a stage end's buffers, the module's tensors moved there), for whoever accounts for a process's memory."""
    with _registry_lock:
        return sorted(_own.items())


def locked_ranges() -> list[tuple[int, int]]:
    """``(start, end)`` of every run locked in this process now."""
    with _registry_lock:
        return [(start, end) for start, (end, _) in _locked.items()]


def lock(run: PageRun) -> str | None:
    """Page-lock ``run`` (on the current CUDA device's context). None once locked, else why not: CUDA's error,
    or the storage locked elsewhere in this process already."""
    with _registry_lock:
        if run.start in _locked:  # runs are whole storages' own pages: another run here is this storage's
            return LOCKED_ELSEWHERE
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(run.start, run.end - run.start, _REGISTER_FLAGS)
        if int(error) != 0:  # a cudaError enum: truthy whatever its value
            return str(cudart.cudaGetErrorString(error))
        _locked[run.start] = (run.end, torch.cuda.current_device())
        return None


def unlock(run: PageRun) -> None:
    """Unlock a run :func:`lock` locked (from any thread); its tensors may be freed afterwards."""
    with _registry_lock:
        locked = _locked.pop(run.start, None)
        if locked is not None:
            _unregister(run.start, locked[1])


def unlock_all(runs: list[PageRun]) -> None:
    """Unlock every run of ``runs`` and empty it: what an owner of locked runs does before it can be freed."""
    while runs:
        unlock(runs.pop())


def _unregister(start: int, device: int) -> None:
    with torch.cuda.device(device):  # the context that locked them; the thread's own device is kept
        error = torch.cuda.cudart().cudaHostUnregister(start)
    if int(error) != 0:
        log.warning("stagesafe: could not unlock page-locked host memory at %#x: %s", start,
                    torch.cuda.cudart().cudaGetErrorString(error))
