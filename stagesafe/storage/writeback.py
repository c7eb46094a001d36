"""Start the kernel's write-back of a file's dirty pages while the file is still being written.

A large file written through the page cache and fsynced only at the end is throttled once its dirty pages pass
the kernel's dirty limits, and the final fsync then waits for all of it: write-back starts late and runs alone.
Asking for it range by range (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait) overlaps
the disk's work with the writing; measured 2-3x faster to durable on the test VM (docs/performance.md). The
final fsync still decides durability; elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Callable

__all__ = ["EVERY", "start_writeback"]

EVERY = 64 * 2**20  # bytes written between two requests: large enough to be cheap, small enough to start early
_SYNC_FILE_RANGE_WRITE = 2


def _load() -> Callable[[int, int, int], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    call.restype = ctypes.c_int

    def start(fd: int, offset: int, length: int) -> None:
        call(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a hint: a failure only loses the overlap

    return start


_START = _load()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` to disk, without waiting."""
    if _START is not None and length > 0:
        _START(fd, offset, length)
