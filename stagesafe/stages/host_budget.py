"""Whether the host can give what a training stage's end will add, asked before its first step.

A kernel's out-of-memory kill is the worst way for a job to end: no error, no cleanup, nothing to catch, and
here it would come after the stage's training. So before the first step every rank says what its end will add
to host memory (:class:`Needs`: private copies of the shards it writes, the optimizer state it keeps, new
tensors) and what its host can give (``MemAvailable``, and the cgroup memory limits it lives under, page cache
that can be reclaimed counted as free), and the ranks of one host are added up, since they share it. On a
shortfall every rank raises the same :class:`~stagesafe.errors.HostMemoryError`, naming the bytes and the ways
out, before any step.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass, field

from stagesafe.errors import HostMemoryError
from stagesafe.stages import collectives

__all__ = ["Headroom", "Needs", "check", "headroom", "memory_cgroups", "shortfalls"]

GIB = 2**30
MARGIN = 2 * GIB  # left to everything else on the host: the interpreter's own growth, the page cache
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a number close to 2**63


@dataclass(frozen=True)
class Needs:
    """Bytes a stage's end adds to one rank's host memory, by what they are for; ``released``: bytes let go
    before those are made (the last write's private copies, once its share is written)."""

    private_copies: int = 0
    kept_state: int = 0
    new_tensors: int = 0
    moving: int = 0  # a tensor being moved into pages of its own: held twice for a moment
    released: int = 0

    @property
    def total(self) -> int:
        return max(0, self.private_copies + self.kept_state + self.new_tensors + self.moving - self.released)


@dataclass(frozen=True)
class Headroom:
    """What a host can give a process: ``available`` bytes, and what set that number."""

    available: int
    because: str
    limits: list[str] = field(default_factory=list)


def headroom(proc: str = "/proc", sys_fs: str = "/sys/fs/cgroup") -> Headroom:
    """The bytes this process can still take: ``MemAvailable``, or less where a cgroup it is in has a memory
    limit (its limit less its usage, reclaimable page cache counted as free)."""
    available = _mem_available(proc)
    best = Headroom(available, f"MemAvailable {_gib(available)}")
    limits = []
    for where, limit, free in _cgroup_limits(proc, sys_fs):
        limits.append(f"cgroup {where}: limit {_gib(limit)}, free {_gib(free)}")
        if free < best.available:
            best = Headroom(free, f"the memory limit of cgroup {where} ({_gib(limit)}, {_gib(free)} of it free)")
    return Headroom(best.available, best.because, limits)


def shortfalls(reports: list[dict], margin: int = MARGIN) -> list[dict]:
    """Per host where the ranks' needs together pass what it can give less ``margin``: its ranks, what they need
    and what it has. ``reports``: each rank's ``{"host", "rank", "needs", "headroom"}``."""
    hosts: dict[str, list[dict]] = {}
    for report in reports:
        hosts.setdefault(report["host"], []).append(report)
    short = []
    for host, ranks in sorted(hosts.items()):
        need = sum(Needs(**r["needs"]).total for r in ranks)
        room = min(ranks, key=lambda r: r["headroom"]["available"])["headroom"]
        if need > room["available"] - margin:
            short.append({"host": host, "ranks": [r["rank"] for r in ranks], "need": need, "headroom": room,
                          "needs": [Needs(**r["needs"]) for r in ranks]})
    return short


def check(needs: Needs, *, stage: str, margin: int = MARGIN) -> None:
    """Every rank says what its stage's end adds and what its host has (a collective: every rank calls it, in
    step); raise :class:`HostMemoryError` on every rank where a host's ranks together need more than it can
    give less ``margin``."""
    report = {"host": socket.gethostname(), "rank": collectives.rank(), "needs": asdict(needs),
              "headroom": asdict(headroom())}
    reports = collectives.gather_all(lambda: report, "asking the host for the end's memory")
    short = shortfalls(reports, margin)
    if short:
        raise HostMemoryError(_message(short, stage, margin))


def _message(short: list[dict], stage: str, margin: int) -> str:
    lines = []
    private = kept = 0
    for host in short:
        needs = host["needs"]
        parts = {
            "private copies of the handoff's shards": sum(n.private_copies for n in needs),
            "the optimizer state kept after the fit": sum(n.kept_state for n in needs),
            "new host tensors (zero.Init's layers, fp32 masters of 16-bit ones)": sum(n.new_tensors for n in needs),
            "a tensor moving into pages of its own": sum(n.moving for n in needs),
        }
        private, kept = max(private, sum(n.private_copies for n in needs)), max(kept, sum(n.kept_state for n in needs))
        shown = ", ".join(f"{what} {_gib(n)}" for what, n in parts.items() if n)
        room = host["headroom"]
        lines.append(
            f"host {host['host']} (rank(s) {', '.join(map(str, host['ranks']))}): the end of this {stage} needs "
            f"{_gib(host['need'])} more host memory ({shown}), and the host can give {_gib(room['available'])} "
            f"({room['because']}) less {_gib(margin)} left to the rest of the processes"
        )
    ways = []
    if kept:
        ways.append(f"StageSafeDeepSpeedStrategy(keep_optimizer_state=False) keeps no optimizer state between calls "
                    f"(saves {_gib(kept)} here)")
    if private:
        ways.append(f"between_stages='meta' holds no weights between calls and writes the handoff one tensor at a time "
                    f"(saves the private copies, {_gib(private)} here, and the module's own weights)")
    ways += ["fewer ranks per host share its memory among fewer", "a host with more memory",
             "check_host_memory=False skips this check (the kernel may then end the job as the stage ends)"]
    return "; ".join(lines) + ". Nothing has been trained yet. Ways out: " + "; ".join(ways) + "."


def _mem_available(proc: str) -> int:
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _UNLIMITED  # not Linux, or no /proc: nothing known to check against


def _cgroup_limits(proc: str, sys_fs: str) -> list[tuple[str, int, int]]:
    """(cgroup, limit, free) of every cgroup this process is in, or an ancestor of it, that limits memory."""
    found = []
    for version, folder, root in memory_cgroups(proc, sys_fs):
        path = folder
        while True:
            limit, free = _limit_and_free(version, path)
            if limit is not None and limit < _UNLIMITED:
                found.append((path, limit, free))
            if os.path.normpath(path) == os.path.normpath(root):
                break
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
    return found


def memory_cgroups(proc: str, sys_fs: str) -> list[tuple[int, str, str]]:
    """(version, this process's cgroup folder, the hierarchy's mount point) for each memory hierarchy."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    mounts = _cgroup_mounts(proc, sys_fs)
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        version = 2 if controllers == "" else 1 if "memory" in controllers.split(",") else 0
        if not version or version not in mounts:
            continue
        mount_root, mount_point = mounts[version]
        relative = path[len(mount_root):] if path.startswith(mount_root) else ""
        folder = os.path.join(mount_point, relative.lstrip("/")) if relative.strip("/") else mount_point
        if os.path.isdir(folder):
            found.append((version, folder, mount_point))
    return found


def _cgroup_mounts(proc: str, sys_fs: str) -> dict[int, tuple[str, str]]:
    """Version -> (the cgroup path mounted, where) of the memory hierarchies, from ``mountinfo``."""
    mounts: dict[int, tuple[str, str]] = {}
    try:
        with open(os.path.join(proc, "self", "mountinfo")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if len(fields) < 5 or len(after) < 3:
            continue
        root, point, fstype, options = fields[3], fields[4], after[0], after[2]
        if fstype == "cgroup2" and 2 not in mounts:
            mounts[2] = (root, point)
        elif fstype == "cgroup" and "memory" in options.split(",") and 1 not in mounts:
            mounts[1] = (root, point)
    if not mounts and os.path.isdir(sys_fs):  # no mountinfo: the usual places
        if os.path.exists(os.path.join(sys_fs, "memory", "memory.limit_in_bytes")):
            mounts[1] = ("/", os.path.join(sys_fs, "memory"))
        elif os.path.exists(os.path.join(sys_fs, "cgroup.controllers")):
            mounts[2] = ("/", sys_fs)
    return mounts


def _limit_and_free(version: int, folder: str) -> tuple[int | None, int]:
    names = ("memory.max", "memory.current", "inactive_file") if version == 2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    limit_text = _read(os.path.join(folder, names[0]))
    usage_text = _read(os.path.join(folder, names[1]))
    if limit_text is None or usage_text is None:
        return None, 0
    limit = _UNLIMITED if limit_text == "max" else int(limit_text)
    usage = int(usage_text)
    reclaimable = 0
    stat = _read(os.path.join(folder, "memory.stat")) or ""
    for line in stat.splitlines():
        key, _, value = line.partition(" ")
        if key == names[2] and value.strip().isdigit():
            reclaimable = int(value)
    return limit, max(0, limit - usage + reclaimable)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
