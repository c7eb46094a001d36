"""Host memory that the ranks of one host share: an anonymous memory file (``memfd``), no name in any folder.

Rank 0 makes it (:meth:`SharedRegion.create`) and tells the others its process id and descriptor; they open it
through ``/proc/<pid>/fd/<fd>`` (:meth:`SharedRegion.open`) while rank 0 keeps that descriptor, which it then
closes: from there on the mappings alone keep the memory, and it goes back to the system when the last one goes,
whichever way the processes end (nothing is left in ``/dev/shm``, whose size containers often limit).

Its first page is a header of one byte per rank, which each rank sets once it has written its part
(:meth:`mark`) and any rank waits for (:meth:`wait`). Each rank maps it twice: ``shared``, where it writes its
part for all, and, once written, a copy-on-write mapping (:meth:`private`) that reads the same pages until the
rank writes to it: such a write stays the rank's own, as if each held its own copy, and costs pages only then.
"""

from __future__ import annotations

import mmap
import os
import time

import torch

__all__ = ["SharedRegion", "PENDING", "WRITTEN", "FAILED"]

PENDING, WRITTEN, FAILED = 0, 1, 2
HEADER = mmap.PAGESIZE


class SharedRegion:
    """``nbytes`` of host memory after a one-page header, mapped by each of ``ranks`` processes of one host."""

    def __init__(self, fd: int, nbytes: int, ranks: int) -> None:
        """Map the memory file ``fd`` (of the header and ``nbytes``), and own that descriptor."""
        if ranks > HEADER:
            raise ValueError(f"{ranks} ranks on one host: the header holds {HEADER}")
        self.nbytes, self.ranks = nbytes, ranks
        self._fd: int | None = fd
        size = HEADER + nbytes
        self._shared = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._private = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, nbytes: int, ranks: int) -> "SharedRegion":
        """Rank 0's: a new memory file of the header and ``nbytes`` (its pages are taken as they are written)."""
        fd = os.memfd_create("stagesafe-shared", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, HEADER + nbytes)
            return cls(fd, nbytes, ranks)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, pid: int, fd: int, nbytes: int, ranks: int) -> "SharedRegion":
        """Another rank's: the memory file rank 0 (process ``pid``) holds as descriptor ``fd``."""
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(own).st_size != HEADER + nbytes:
                raise OSError(f"/proc/{pid}/fd/{fd} is not a shared region of {HEADER + nbytes} bytes")
            region = cls(own, nbytes, ranks)
        except BaseException:
            os.close(own)
            raise
        region.close_fd()
        return region

    @property
    def fd(self) -> int:
        """The descriptor the other ranks open (rank 0's, until :meth:`close_fd`)."""
        if self._fd is None:
            raise ValueError("the shared region's descriptor is closed")
        return self._fd

    def close_fd(self) -> None:
        """Every rank has opened it: the descriptor goes, the mappings keep the memory."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def shared(self) -> torch.Tensor:
        """The region (header left out) as bytes every rank sees written."""
        return torch.frombuffer(self._shared, dtype=torch.uint8, offset=HEADER, count=self.nbytes)

    def private(self) -> torch.Tensor:
        """The region as this rank's copy-on-write bytes: what every rank wrote, until this rank writes there."""
        return torch.frombuffer(self._private, dtype=torch.uint8, offset=HEADER, count=self.nbytes)

    def mark(self, rank: int, state: int) -> None:
        """This rank's part is ``WRITTEN``, or ``FAILED`` (no rank waits for it any more)."""
        self._shared[rank] = state

    def states(self) -> list[int]:
        return list(self._shared[: self.ranks])

    def wait(self, timeout: float) -> bool:
        """Whether every rank's part is written, waiting ``timeout`` seconds at most; False at once where a
        rank failed."""
        deadline, pause = time.monotonic() + timeout, 0.001
        while True:
            states = self.states()
            if FAILED in states:
                return False
            if all(state == WRITTEN for state in states):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
