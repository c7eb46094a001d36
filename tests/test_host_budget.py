"""Asking the host for a stage's end before its first step (stagesafe/stages/host_budget.py): what a host can give
(MemAvailable, cgroup v1 and v2 limits, read from files laid out as the kernel lays them out), the ranks of one host
added up, and the error every rank raises."""

from __future__ import annotations

import pytest

from stagesafe.errors import HostMemoryError
from stagesafe.stages import host_budget
from stagesafe.stages.host_budget import GIB, Needs, headroom, shortfalls


def _proc(tmp_path, *, available_kib: int, cgroup: str, mountinfo: str) -> str:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       100000000 kB\nMemFree: 1 kB\nMemAvailable:   {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    return str(proc)


def test_without_a_cgroup_limit_the_host_gives_what_the_kernel_calls_available(tmp_path):
    proc = _proc(tmp_path, available_kib=8 * 2**20, cgroup="0::/\n", mountinfo="")
    room = headroom(proc, str(tmp_path / "no-cgroup-fs"))
    assert room.available == 8 * GIB and room.because == "MemAvailable 8.0 GiB" and room.limits == []


def test_a_cgroup_v2_limit_above_or_below_the_process_sets_the_headroom(tmp_path):
    fs = tmp_path / "cg"
    job = fs / "job.slice" / "run-1.scope"
    job.mkdir(parents=True)
    (fs / "job.slice" / "memory.max").write_text(f"{6 * GIB}\n")  # a parent's limit binds too
    (fs / "job.slice" / "memory.current").write_text(f"{5 * GIB}\n")
    (fs / "job.slice" / "memory.stat").write_text(f"anon 1\ninactive_file {GIB // 2}\n")  # reclaimable cache
    (job / "memory.max").write_text("max\n")
    (job / "memory.current").write_text(f"{4 * GIB}\n")
    (job / "memory.stat").write_text("inactive_file 0\n")
    mountinfo = f"30 25 0:26 / {fs} rw,nosuid - cgroup2 cgroup2 rw\n"
    proc = _proc(tmp_path, available_kib=64 * 2**20, cgroup="0::/job.slice/run-1.scope\n", mountinfo=mountinfo)
    room = headroom(proc, str(fs))
    assert room.available == GIB + GIB // 2  # 6 - 5 + 0.5 of cache, below the host's 64
    assert "job.slice" in room.because and len(room.limits) == 1


def test_a_cgroup_v1_memory_limit_is_read_from_its_own_hierarchy(tmp_path):
    fs = tmp_path / "cg" / "memory"
    job = fs / "batch" / "42"
    job.mkdir(parents=True)
    (job / "memory.limit_in_bytes").write_text(f"{3 * GIB}\n")
    (job / "memory.usage_in_bytes").write_text(f"{2 * GIB}\n")
    (job / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {GIB // 4}\n")
    (fs / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # the root: no limit
    (fs / "memory.usage_in_bytes").write_text(f"{50 * GIB}\n")
    mountinfo = (f"40 25 0:35 / {tmp_path / 'cg' / 'cpu'} rw - cgroup cgroup rw,cpu\n"
                 f"41 25 0:36 / {fs} rw - cgroup cgroup rw,memory\n")
    cgroup = "5:cpu:/batch/42\n4:memory:/batch/42\n"
    room = headroom(_proc(tmp_path, available_kib=32 * 2**20, cgroup=cgroup, mountinfo=mountinfo), str(tmp_path))
    assert room.available == GIB + GIB // 4 and "42" in room.because


def _report(host: str, rank: int, need: int, available: int) -> dict:
    return {"host": host, "rank": rank, "needs": {"private_copies": need},
            "headroom": {"available": available, "because": f"MemAvailable {available / GIB:.1f} GiB", "limits": []}}


def test_the_ranks_of_one_host_share_it_and_each_host_is_judged_on_its_own():
    fine = [_report("a", 0, 3 * GIB, 10 * GIB), _report("a", 1, 3 * GIB, 10 * GIB)]  # 6 of 10 - 2
    assert shortfalls(fine) == []
    crowded = [*fine, _report("a", 2, 3 * GIB, 10 * GIB), _report("b", 3, 3 * GIB, 10 * GIB)]  # a: 9 > 8
    (short,) = shortfalls(crowded)
    assert short["host"] == "a" and short["ranks"] == [0, 1, 2] and short["need"] == 9 * GIB
    assert shortfalls(crowded, margin=0) == []  # 9 of 10 without the margin


def test_a_shortfall_is_one_error_on_every_rank_with_the_bytes_and_the_ways_out(monkeypatch):
    monkeypatch.setattr(host_budget, "headroom", lambda: host_budget.Headroom(3 * GIB, "MemAvailable 3.0 GiB"))
    needs = Needs(private_copies=2 * GIB, kept_state=4 * GIB)
    with pytest.raises(HostMemoryError) as caught:
        host_budget.check(needs, stage="fit")
    message = str(caught.value)
    assert "needs 6.0 GiB more host memory" in message and "can give 3.0 GiB (MemAvailable 3.0 GiB)" in message
    assert "the optimizer state kept after the fit 4.0 GiB" in message and "Nothing has been trained yet" in message
    for way_out in ("keep_optimizer_state=False", "between_stages='meta'", "fewer ranks per host",
                    "check_host_memory=False"):
        assert way_out in message
    assert isinstance(caught.value, MemoryError)
    host_budget.check(Needs(private_copies=GIB // 2), stage="fit")  # 0.5 of 3 - 2: room enough
