"""This process's peak resident memory over a stretch of work (tests/scripts' benchmarks of the resume): the
kernel's own high-water mark, exact, where it can be reset."""

from __future__ import annotations

import ctypes
import os
import threading


class RssPeak:
    """This process's peak resident memory between ``start`` and ``stop``: the kernel's own high-water mark
    (VmHWM, reset at ``start`` by writing 5 to /proc/self/clear_refs, after the C heap gave its free pages back),
    and where that cannot be reset, samples every 10 ms on a thread. The reset also resets what ``getrusage``
    gives as ``ru_maxrss``: the process's peak is the larger of ``earlier`` and it."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.before = self.peak = self.after = 0
        self.earlier = 0  # the process's peak before ``start`` (the reset loses it from getrusage too)
        self.exact = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    @staticmethod
    def high_water_mark() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    def start(self) -> None:
        self.earlier = self.high_water_mark()
        try:
            ctypes.CDLL(None).malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.exact = True
        except (OSError, AttributeError):
            self.exact = False
        self.before = self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.rss())

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.after = self.rss()
        self.peak = max(self.peak, self.after, self.high_water_mark() if self.exact else 0)
