"""Early write-back: the disk starts on a file's first bytes while the rest is still being written."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time

import pytest

from stagesafe.storage.fs import resolve, write_atomic
from stagesafe.storage.writeback import EVERY, start_writeback

_CACHESTAT = 451  # Linux >= 6.5, same number on x86_64 and arm64


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def dirty_pages(fd: int) -> int:
    """Pages of the file still dirty in the page cache (the kernel's cachestat), or skip where it is missing."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("cachestat is a Linux syscall")
    libc = ctypes.CDLL(None, use_errno=True)
    stat = _Stat()
    if libc.syscall(_CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(stat), 0) != 0:
        pytest.skip(f"no cachestat here: {os.strerror(ctypes.get_errno())}")
    return stat.dirty


def _filesystem_type(path) -> str:
    """The type of the filesystem holding ``path``, from the mount table (the longest mount point above it)."""
    best, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


def test_start_writeback_cleans_the_pages_without_fsync(tmp_path):
    """Without the request the pages would stay dirty for the kernel's 30 s expiry (64 MB is far below its
    background limit); with it they are written out at once, while this process goes on."""
    if not sys.platform.startswith("linux"):
        pytest.skip("sync_file_range and cachestat are Linux calls")
    if _filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a memory filesystem writes nothing back")
    path = tmp_path / "file.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(EVERY))
        f.flush()
        assert dirty_pages(f.fileno()) > 0
        start_writeback(f.fileno(), 0, EVERY)
        deadline = time.monotonic() + 10
        while dirty_pages(f.fileno()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dirty_pages(f.fileno()) == 0


def test_write_atomic_in_many_chunks_writes_every_byte(tmp_path):
    """The writer asks for write-back every EVERY bytes, mid-file: the bytes are exactly those given."""
    chunk = os.urandom(EVERY // 3 + 7)
    fs, root = resolve(str(tmp_path))
    write_atomic(fs, f"{root}/out.bin", [chunk, memoryview(chunk)] * 4)
    assert (tmp_path / "out.bin").read_bytes() == chunk * 8
