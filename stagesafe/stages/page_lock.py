"""Page-locking host tensors in place, by whole pages, each page once per process.

CUDA copies into page-locked memory at the bus's speed and into pageable memory at a fifth of it (H200 host:
54 against 10 GB/s). ``cudaHostRegister`` locks whole pages, and refuses a page this process has locked
already. A tensor under 32 MB may come from the C heap and share its first and last page with other
allocations, so tensors are locked by *runs*: each tensor's bytes rounded out to whole pages, overlapping or
touching ranges merged, each run registered once. Every page of a run holds bytes of a tensor the run keeps
alive, so no allocator returns it to the system while it is locked; other bytes on those pages are only
pinned, never written. A run that overlaps one locked elsewhere in the process is left out (its tensors copy
from pageable memory) rather than refused by CUDA.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import Iterable

import torch

__all__ = ["LOCKED_ELSEWHERE", "PageRun", "lock", "page_runs", "unlock"]

PAGE = mmap.PAGESIZE
LOCKED_ELSEWHERE = "already page-locked in part by this process"
_REGISTER_FLAGS = 0  # cudaHostRegisterDefault: for this device's context, the one its copies run in

_registry_lock = threading.Lock()
_locked: dict[int, int] = {}  # start -> end of every run this process has locked


@dataclass
class PageRun:
    """Consecutive whole pages ``[start, end)`` that hold the bytes of ``tensors`` (kept alive while locked)."""

    start: int
    end: int
    tensors: list[torch.Tensor] = field(default_factory=list)

    def holds(self, ptr: int) -> bool:
        return self.start <= ptr < self.end


def page_runs(tensors: Iterable[torch.Tensor]) -> list[PageRun]:
    """The pages holding the bytes of ``tensors`` that can be locked (CPU, contiguous, not pinned already,
    not empty), as runs: each tensor's range rounded out to pages, ranges that overlap or touch merged."""
    ranges = []
    seen: set[tuple[int, int]] = set()
    for tensor in tensors:
        if tensor.device.type != "cpu" or not tensor.numel() or not tensor.is_contiguous() or tensor.is_pinned():
            continue
        ptr = tensor.data_ptr()
        if (ptr, tensor.nbytes) in seen:
            continue
        seen.add((ptr, tensor.nbytes))
        ranges.append((ptr - ptr % PAGE, -(-(ptr + tensor.nbytes) // PAGE) * PAGE, tensor))
    runs: list[PageRun] = []
    for start, end, tensor in sorted(ranges, key=lambda r: r[0]):
        if runs and start <= runs[-1].end:
            runs[-1].end = max(runs[-1].end, end)
            runs[-1].tensors.append(tensor)
        else:
            runs.append(PageRun(start, end, [tensor]))
    return runs


def lock(run: PageRun) -> str | None:
    """Page-lock ``run`` (on the current CUDA device's context). None once locked, else why not: CUDA's error,
    or a run locked elsewhere in this process overlapping it."""
    with _registry_lock:
        if any(start < run.end and run.start < end for start, end in _locked.items()):
            return LOCKED_ELSEWHERE
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(run.start, run.end - run.start, _REGISTER_FLAGS)
        if int(error) != 0:  # a cudaError enum: truthy whatever its value
            return str(cudart.cudaGetErrorString(error))
        _locked[run.start] = run.end
        return None


def unlock(run: PageRun) -> None:
    """Unlock a run :func:`lock` locked; its tensors may be freed afterwards."""
    with _registry_lock:
        if _locked.pop(run.start, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(run.start)
