"""Checkpoint reads into device memory through a bounded host buffer.

A checkpoint's bytes are read with ``pread`` into host memory; an engine whose partitions live on a GPU would
otherwise need this rank's whole optimizer partition (12 bytes per parameter with Adam) in host memory before
DeepSpeed copies it over. :func:`read_staged` reads such targets a batch at a time into a staging buffer of
at most :data:`STAGING_BYTES` and copies each batch to the device: two halves, page-locked on CUDA, so one
half is read while the other is copied (and given back when the reads are done). Targets in host memory are
read straight into, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["STAGING_BYTES", "read_staged"]

STAGING_BYTES = 256 * 2**20  # host memory a staged read holds at once: two halves of 128 MiB
_ALIGN = 64  # bytes: every view of the staging buffer starts at a multiple of this (any dtype's alignment)

Read = tuple[str, "str | None", int, "torch.Tensor"]  # (name, key, first element, where it goes)


def _in_host_memory(out: "torch.Tensor") -> bool:
    return out.device.type == "cpu"


def read_staged(
    read_all: Callable[[list[Read]], None],
    reads: Sequence[Read],
    *,
    staging_bytes: int | None = None,
    direct: Callable[["torch.Tensor"], bool] | None = None,
) -> int:
    """Each ``(name, key, first, out)`` of ``reads`` done by ``read_all`` (a checkpoint source's: it reads into
    contiguous host tensors): those ``direct`` accepts (in host memory) straight into ``out``, the others a batch
    at a time through a host buffer of ``staging_bytes`` (default :data:`STAGING_BYTES`), split where one is
    larger than half of it. Returns the host bytes the staging buffer took (0 when nothing was staged)."""
    import torch

    staging_bytes = STAGING_BYTES if staging_bytes is None else staging_bytes
    direct = _in_host_memory if direct is None else direct
    straight = [r for r in reads if direct(r[3])]
    if straight:
        read_all(straight)
    half = max(_ALIGN, staging_bytes // 2 // _ALIGN * _ALIGN)
    batches = _batches([r for r in reads if not direct(r[3])], half)
    if not batches:
        return 0
    device = batches[0][0][3].device
    pinned = device.type == "cuda" and torch.cuda.is_available()
    buffers = [torch.empty(half, dtype=torch.uint8, pin_memory=pinned) for _ in range(min(2, len(batches)))]
    done: list = [None] * len(buffers)  # per half: the event its last copies to the device record
    for number, batch in enumerate(batches):
        which = number % len(buffers)
        if done[which] is not None:
            done[which].synchronize()  # its bytes reached the device: the half may be read into again
        views, at = [], 0
        for _, _, _, out in batch:
            nbytes = out.numel() * out.element_size()
            views.append(buffers[which].narrow(0, at, nbytes).view(out.dtype))
            at += _aligned(nbytes)
        read_all([(name, key, first, view) for (name, key, first, _), view in zip(batch, views)])
        for (_, _, _, out), view in zip(batch, views):
            out.copy_(view, non_blocking=pinned)
        if pinned:
            done[which] = torch.cuda.Event()
            done[which].record(torch.cuda.current_stream(device))
    for event in done:
        if event is not None:
            event.synchronize()
    took = half * len(buffers)
    del buffers, views
    if pinned:  # torch keeps freed page-locked memory for reuse: give it back, the load is over
        getattr(torch._C, "_host_emptyCache", lambda: None)()
    return took


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _batches(reads: list[Read], capacity: int) -> list[list[Read]]:
    """``reads`` cut into runs of at most ``capacity`` bytes each, packed in order into batches whose aligned
    sizes add up to at most ``capacity``."""
    pieces: list[Read] = []
    for name, key, first, out in reads:
        step = max(1, capacity // out.element_size())
        for at in range(0, out.numel(), step):
            pieces.append((name, key, first + at, out.narrow(0, at, min(step, out.numel() - at))))
    batches: list[list[Read]] = []
    used = capacity + 1
    for piece in pieces:
        nbytes = _aligned(piece[3].numel() * piece[3].element_size())
        if used + nbytes > capacity:
            batches.append([])
            used = 0
        batches[-1].append(piece)
        used += nbytes
    return batches
