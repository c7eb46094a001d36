"""A build of DeepSpeed's CPU comm op is said, whether the library is missing or stale; a lock left there is named.

The watch looks at real files in a folder of the test's own: the library, torch's ``lock`` file while a build
(or an up-to-date run) holds it, and ``build.ninja``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from _launch import sanitized_env

from stagesafe.strategy_bases.comm_op_build import COMM_OP, comm_op_folder, watch_comm_op_build


def _built(folder) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{COMM_OP}.so").write_bytes(b"")
    return str(folder)


def _hold_lock(folder: str, seconds: float) -> None:
    """What torch does around ninja: the lock is there while it runs."""
    lock = os.path.join(folder, "lock")
    with open(lock, "x"):
        pass
    time.sleep(seconds)
    os.remove(lock)


def test_the_folder_is_torchs_for_jit_extensions(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert comm_op_folder() == str(tmp_path / COMM_OP)


def test_a_missing_library_is_said_at_once_with_its_folder(tmp_path):
    said: list[str] = []
    with watch_comm_op_build(said.append, folder=str(tmp_path / COMM_OP)):
        assert len(said) == 1  # before the build starts
    assert f"building its CPU comm op in {tmp_path / COMM_OP}: it is not built there yet" in said[0]
    assert "30 s to a few minutes" in said[0] and "troubleshooting" in said[0]


def test_a_stale_library_rebuilt_is_said_once_with_why(tmp_path):
    folder = _built(tmp_path / COMM_OP)
    (tmp_path / COMM_OP / "build.ninja").write_text("cflags = -isystem /other/venv/site-packages/torch/include -fPIC\n")
    said: list[str] = []
    with watch_comm_op_build(said.append, folder=folder, after=0.3, poll=0.05):
        _hold_lock(folder, 1.5)  # a build: the lock is held far longer than an up-to-date run holds it
    assert len(said) == 1, said
    assert f"rebuilding its CPU comm op in {folder}: the library there is out of date" in said[0]
    assert "built against the torch in /other/venv/site-packages" in said[0] and "ninja here is" in said[0]


def test_an_up_to_date_library_is_not_said(tmp_path):
    folder = _built(tmp_path / COMM_OP)
    said: list[str] = []
    with watch_comm_op_build(said.append, folder=folder, after=5.0, poll=0.05):
        _hold_lock(folder, 0.2)  # ninja finds nothing to do
    assert said == []


def test_a_lock_there_before_the_watch_is_named(tmp_path):
    folder = _built(tmp_path / COMM_OP)
    lock = os.path.join(folder, "lock")
    open(lock, "x").close()
    os.utime(lock, (time.time() - 600, time.time() - 600))  # left by a build killed ten minutes ago
    said: list[str] = []
    release = threading.Timer(1.5, os.remove, args=(lock,))  # the test's stand-in for the user deleting it
    release.start()
    with watch_comm_op_build(said.append, folder=folder, after=0.3, poll=0.05):
        release.join()
    assert len(said) == 1 and f"waiting for {lock}" in said[0] and "delete the lock file" in said[0], said


_LOAD = """
from deepspeed.accelerator import get_accelerator
from stagesafe.strategy_bases.comm_op_build import watch_comm_op_build
with watch_comm_op_build(lambda line: print("SAID", line, flush=True)):
    get_accelerator().create_op_builder("ShareMemCommBuilder").load()
print("LOADED", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_rebuild_of_a_stale_build_is_said(tmp_path):
    """The environment's own build, copied, with an object file gone (the library is there, out of date): torch
    and ninja rebuild it, which the watch says in one line, as DeepSpeed's comm backend loads it."""
    built = comm_op_folder()
    if not os.path.isfile(os.path.join(built, f"{COMM_OP}.so")):
        pytest.skip(f"DeepSpeed's CPU comm op is not built in {built} yet")
    shutil.copytree(built, tmp_path / COMM_OP)
    os.remove(tmp_path / COMM_OP / "shm.o")
    env = sanitized_env({"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    result = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stdout.splitlines() if line.startswith("SAID ")]
    assert len(said) == 1 and f"rebuilding its CPU comm op in {tmp_path / COMM_OP}" in said[0], result.stdout
    assert "LOADED" in result.stdout and (tmp_path / COMM_OP / "shm.o").is_file()
