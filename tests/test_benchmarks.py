"""Benchmarks and scripts stay in step with the package: each one's imports and definitions run.

They are not run by the suite (they time things), so an API they use that moved would otherwise go unnoticed
until someone tries to reproduce a documented number.
"""

from __future__ import annotations

import glob
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
