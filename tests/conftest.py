"""Shared fixtures. The S3 server starts only when a test asks for it (moto is slow to import)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

# DeepSpeed JIT-builds its CPU comm op once per environment; a folder per venv keeps two checkouts from rebuilding
# each other's (the build is keyed by the source path). The processes the tests start inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
# And one ninja, the environment's own, as scripts/dev.sh has it: a build by another ninja is redone.
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])

# Fixtures that run Trainer or DeepSpeed jobs (seconds to minutes): the tests that use them are left out of the
# fast tier (scripts/dev.sh test-fast).
_JOB_FIXTURES = {"ckpts", "ranks", "one_rank_fails", "stagesafe_run", "stock_run", "run_fault"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _JOB_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def in_process(tmp_path):
    """Trainer calls in this process (one CPU rank): the process group, environment and DeepSpeed accelerator
    they set are undone afterwards."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    from _launch import end_process_group

    environ, accelerator = dict(os.environ), get_accelerator()
    try:
        yield tmp_path
    finally:
        end_process_group()
        os.environ.clear()
        os.environ.update(environ)
        set_accelerator(accelerator)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 and a free port, for the whole session (see tests/_s3.py)."""
    from _s3 import running_server

    with running_server() as server:
        yield server


@pytest.fixture
def s3(s3_server):
    """The session's S3 server, running and without rules, however the previous test left it."""
    s3_server.clear_rules()
    s3_server.start()
    yield s3_server
    s3_server.clear_rules()
    s3_server.start()


class Tmpfs:
    """A small tmpfs mounted for one test (root with CAP_SYS_ADMIN only): a disk that can be full or read-only."""

    def __init__(self, path: str, size: str) -> None:
        self.path = path
        os.makedirs(path)
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "stagesafe-test", path]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}): needs root with CAP_SYS_ADMIN")

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", self.path], check=True, capture_output=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", self.path], check=False, capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounts: list[Tmpfs] = []

    def make(size: str) -> Tmpfs:
        mounts.append(Tmpfs(str(tmp_path / f"tmpfs{len(mounts)}"), size))
        return mounts[-1]

    yield make
    for mount in mounts:
        mount.unmount()
