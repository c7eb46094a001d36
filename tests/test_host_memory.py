"""Host memory over a sequence of Trainer calls, measured on real 2-rank CPU jobs: a later fit needs no more than the
first (the kept state is held once, and let go as the next engine takes over), and a fit whose end the host cannot
hold is refused on every rank before its first step, under a real cgroup memory limit."""

from __future__ import annotations

import json
import os
import time

import pytest
from _launch import run_script

from stagesafe.stages.host_budget import memory_cgroups

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GIB = 2**30

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_later_fit_peaks_no_higher_than_the_first_with_the_optimizer_state_kept(tmp_path):
    """fit -> fit -> fit -> test of a 200M-parameter MLP with AdamW on 2 ranks, a new Trainer per call. glibc's
    heap is told to map large blocks on their own (``MALLOC_MMAP_THRESHOLD_``), so that what a rank holds, not
    where the allocator happened to place and keep freed blocks, is what the peaks show."""
    out = tmp_path / "rows.json"
    script = os.path.join(ROOT, "benchmarks", "bench_host_memory.py")
    args = ["--model", "mlp", "--layers", "48", "--width", "2048", "--steps", "1", "--sequence", "fit", "fit", "fit", "test",
            "--root", str(tmp_path), "--json", str(out)]
    run_script(script, args, timeout=840, env={"MALLOC_MMAP_THRESHOLD_": str(4 << 20)})
    seen = json.loads(out.read_text())
    assert seen["parameters"] > 200e6
    for rows in seen["ranks"]:
        fits = [row for row in rows if row["call"] == "fit"]
        kept = fits[0]["kept_bytes"]
        assert kept == pytest.approx(8 * seen["parameters"] / 2, rel=0.01)  # AdamW's moments: this rank's half
        assert all(row["kept_bytes"] == kept for row in fits)  # one kept state at a time
        first = fits[0]["rss_peak"]
        assert all(row["rss_peak"] - first <= 0.25 * kept for row in fits[1:]), (first, fits)


def _own_memory_cgroup() -> tuple[int, str] | None:
    found = memory_cgroups("/proc", "/sys/fs/cgroup")
    return (found[0][0], found[0][1]) if found else None


def _child_cgroup(tmp_path) -> tuple[int, str]:
    """A memory cgroup of this test's own, below the one this process is in; skips where none can be made."""
    own = _own_memory_cgroup()
    if own is None:
        pytest.skip("no memory cgroup hierarchy is mounted here")
    version, folder = own
    child = os.path.join(folder, f"stagesafe-test-{os.getpid()}-{tmp_path.name}")
    try:
        os.mkdir(child)
        if version == 2:
            with open(os.path.join(folder, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup below {folder}: {exc}")
    return version, child


def _remove(cgroup: str) -> None:
    """Remove the test's cgroup once the kernel has let go of its exited processes (it says busy until then)."""
    for _ in range(100):
        try:
            os.rmdir(cgroup)
            return
        except OSError:
            time.sleep(0.1)
    os.rmdir(cgroup)


def test_a_fit_whose_end_the_hosts_memory_cannot_hold_is_refused_on_every_rank_before_any_step(tmp_path):
    version, cgroup = _child_cgroup(tmp_path)
    try:
        script = os.path.join(HERE, "scripts", "host_budget_refusal.py")
        done = run_script(script, [cgroup, str(version), str(tmp_path), str(3 * GIB // 2)], timeout=300)
    finally:
        _remove(cgroup)
    seen = sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                  key=lambda s: s["rank"])
    assert [s["rank"] for s in seen] == [0, 1], done.stdout[-3000:] + done.stderr[-3000:]
    for rank in seen:
        assert rank["error"] == "HostMemoryError", rank
        assert "Nothing has been trained yet" in rank["message"] and "more host memory" in rank["message"]
        assert f"memory limit of cgroup {cgroup}" in rank["message"], rank["message"]
        assert rank["global_step"] == 0 and rank["unchanged"]  # refused before any step, the module as it was
