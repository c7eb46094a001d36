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


def host_breakdown(top: int = 6) -> dict:
    """What this process's resident memory is made of, to tell a tensor still referenced from memory the C heap
    kept after a free or from a mapped file: the kernel's split (anonymous, file, shared), anonymous memory again
    after ``malloc_trim``, the CPU tensors Python can still reach (unique storages, the largest kinds), and the
    largest mappings."""
    import collections
    import gc
    import warnings

    import torch

    def status() -> dict:
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}

    out = {"mib": status()}
    try:
        ctypes.CDLL(None).malloc_trim(0)
        out["mib_after_malloc_trim"] = status()
    except (OSError, AttributeError):
        pass
    storages: dict = {}
    kinds: collections.Counter = collections.Counter()
    with warnings.catch_warnings():  # isinstance on some module objects warns of a deprecated name
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage.nbytes() >= 2**20 and storage.data_ptr() not in storages:
                storages[storage.data_ptr()] = storage.nbytes()
                kinds[f"{type(obj).__name__} {obj.dtype} {tuple(obj.shape)}"] += storage.nbytes()
    out["cpu_tensors_mib"] = sum(storages.values()) / 2**20
    out["cpu_tensor_kinds_mib"] = {k: v / 2**20 for k, v in kinds.most_common(top)}
    maps: list = []
    try:
        with open("/proc/self/smaps") as f:
            name = ""
            for line in f:
                first = line.split()
                if "-" in first[0] and not line.startswith(("Rss", "Pss")) and ":" not in first[0]:
                    name = first[5] if len(first) > 5 else "[anon]"
                elif first[0] == "Rss:":
                    maps.append((int(first[1]) / 1024, name))
    except OSError:
        pass
    out["largest_mappings_mib"] = sorted(maps, reverse=True)[:top]
    out["stagesafe_own_pages_mib"] = _own_pages_resident()
    return out


def _own_pages_resident() -> dict:
    """The host memory stagesafe holds in mappings of its own (a stage end's buffers made ready while the stage
    runs, the module's tensors moved there): mapped and resident, from the kernel's smaps."""
    from stagesafe.stages.page_lock import own_mappings

    own = dict(own_mappings())
    mapped = sum(end - start for start, end in own.items())
    resident = 0
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                first = line.split()
                if "-" in first[0] and ":" not in first[0]:
                    start, end = (int(x, 16) for x in first[0].split("-"))
                    inside = own.get(start) == end
                elif inside and first[0] == "Rss:":
                    resident += int(first[1]) * 1024
    except OSError:
        pass
    return {"mapped": mapped / 2**20, "resident": resident / 2**20, "mappings": len(own)}
