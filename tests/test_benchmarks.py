"""Benchmarks and scripts stay in step with the package: each one's imports and definitions run.

They are not run by the suite (they time things), so an API they use that moved would otherwise go unnoticed
until someone tries to reproduce a documented number.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from _launch import sanitized_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")) + glob.glob(os.path.join(ROOT, "scripts", "*.py")))

_CHECK = """
import runpy, sys, traceback
failed = []
for path in sys.argv[1:]:
    sys.path.insert(0, path.rsplit("/", 1)[0])
    try:
        runpy.run_path(path, run_name="not_main")  # top level only: main() is not called
    except BaseException:
        failed.append(path + ":\\n" + traceback.format_exc(limit=3))
    finally:
        sys.path.pop(0)
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
def test_every_benchmark_and_script_imports():
    assert len(FILES) > 5, FILES
    result = subprocess.run([sys.executable, "-c", _CHECK, *FILES], capture_output=True, text=True, timeout=300,
                            env=sanitized_env(), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


# Each benchmark's smallest configuration, run as a user would run it: a benchmark whose documented command fails
# (an argument renamed under it) fails here with the job's last lines. Left out: profile_handoff_write.py and
# profile_host_copy.py (two GPUs under torchrun), stage_matrix.py (its cases are tests/test_trainer_sequences.py's).
SMALLEST = {
    "bench_boundary.py": ["--layers", "1", "--width", "256", "--root", "{tmp}"],
    "bench_leave_fit.py": ["--layers", "1", "--width", "128", "--vocab", "500", "--root", "{tmp}"],
    "bench_meta_rss.py": ["--width", "256", "--layers", "2", "--root", "{tmp}"],
    "bench_host_memory.py": ["--model", "mlp", "--width", "64", "--layers", "2", "--steps", "1", "--sequence", "fit",
                             "test", "--handoff-optimizer-state", "--read-optimizer-state", "--root", "{tmp}"],
    "bench_consolidate.py": ["--hidden", "128", "--layers", "2", "--repeat", "1", "--workdir", "{tmp}"],
    "bench_many_tensors.py": ["--counts", "64", "--arms", "stagesafe", "--save-state-dict", "--floor", "--repeat", "1",
                              "--root", "{tmp}"],
    "bench_load.py": ["--gb", "0.01", "--shard", "5MB", "--repeat", "1", "--root", "{tmp}"],
    "bench_write_digest.py": ["--gb", "0.01", "--rounds", "1", "--root", "{tmp}"],
    "fuzz_hostile.py": ["6", "--seed", "0"],  # the same cases every run: finding new ones is the long run's job
    "hostile_limits.py": ["--repeat", "1"],
    "profile_consolidate.py": ["--hidden", "128", "--layers", "2"],
    "bench_resume.py": ["--hidden", "64", "--layers", "2", "--resumed", "1", "--repeat", "1", "--root", "{tmp}"],
    "rounds_end_after_fit.py": ["--rounds", "1", "--only", "local"],
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_resume_one_gpu_flow_runs_on_the_cpu(tmp_path):
    """``bench_resume.py --one-gpu`` (the command docs/performance.md gives for one GPU) at a tiny size, resumed on
    the CPU: save on 2 CPU ranks, fit(ckpt_path=) on one process, DeepSpeed's ds_to_universal.py beside."""
    out = tmp_path / "out"
    argv = ["--one-gpu", "--accelerator", "cpu", "--hidden", "64", "--layers", "2", "--save-threads", "1",
            "--universal-workers", "2", "--root", str(tmp_path), "--out", str(out)]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_resume.py"), *argv],
                            capture_output=True, text=True, timeout=280, env=sanitized_env(), cwd=str(tmp_path))
    assert result.returncode == 0, "\n".join((result.stdout + result.stderr).splitlines()[-30:])
    facts = json.loads((out / "resume-one-gpu.json").read_text())
    assert facts["stagesafe"]["global_step"] == 3 and facts["stagesafe"]["load_seconds"] > 0
    assert facts["ds_to_universal"]["finished"] and facts["ds_to_universal"]["peak_tree_pss_mib"] > 0
    assert "| stagesafe: fit(ckpt_path=) load" in (out / "resume-one-gpu.md").read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("bench-resume-one-gpu-")] == []  # cleaned up


def test_every_cpu_benchmark_is_run_below():
    on_gpus_or_elsewhere = {"profile_handoff_write.py", "profile_host_copy.py", "stage_matrix.py"}
    names = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))}
    assert names - on_gpus_or_elsewhere == set(SMALLEST), names


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_each_benchmark_runs_its_smallest_configuration(name, tmp_path):
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in SMALLEST[name]]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *argv], capture_output=True,
                            text=True, timeout=280, env=sanitized_env(), cwd=str(tmp_path))
    tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
    assert result.returncode == 0, f"{name} {' '.join(argv)} failed:\n{tail}"
