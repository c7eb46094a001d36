"""Launch test scripts as real processes: N ranks of a torch.distributed script, or one script that spawns its own;
run N ranks as threads of the test's own process, each with its channel on one real key-value store
(:func:`on_every_rank`, :func:`store_channels`: for code that coordinates through the store); or run test
functions on N ranks of a gloo process group kept alive across tests (:class:`GlooRanks`: for collectives, which
need a process per rank).

The launching helpers give the child a sanitized environment (no inherited rendezvous variables, CPU accelerator for
DeepSpeed, one OpenMP thread) and, on failure or timeout, raise :class:`LaunchError` carrying every process's
exit code and the tail of its stderr, so that a failing distributed test says why instead of hanging.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import pickle
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

__all__ = [
    "ZERO_CHECKPOINT_SPECS",
    "GlooRanks",
    "LaunchError",
    "ProcessResult",
    "free_port",
    "on_every_rank",
    "run_ranks",
    "run_script",
    "sanitized_env",
    "store_channels",
    "two_ranks",
    "end_process_group",
    "zero_checkpoints",
]

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")

# Variables that would make a child join someone else's process group or mistake its own rank.
_RENDEZVOUS_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
    "CROSS_RANK",
    "CROSS_SIZE",
    "PL_GLOBAL_SEED",
    "PL_TRAINER_GPUS",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
)
_TAIL_CHARS = 4000


@dataclass
class ProcessResult:
    """What one finished process left behind."""

    name: str
    returncode: int | None  # None: killed on timeout
    stdout: str
    stderr: str


class LaunchError(AssertionError):
    """One or more launched processes failed or timed out; the message holds each one's stderr tail."""

    def __init__(self, summary: str, results: Sequence[ProcessResult]):
        self.results = list(results)
        parts = [summary]
        for r in results:
            status = "timed out (killed)" if r.returncode is None else f"exit code {r.returncode}"
            parts.append(f"--- {r.name}: {status}; stderr tail:\n{r.stderr[-_TAIL_CHARS:]}")
        super().__init__("\n".join(parts))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sanitized_env(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The current environment without rendezvous variables, with CPU DeepSpeed and one OpenMP thread;
    ``extra`` on top (a None value unsets: ``{"DS_ACCELERATOR": None}`` lets DeepSpeed pick a GPU)."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS_VARS}
    env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONUNBUFFERED", None)  # tests/_launched/sitecustomize.py writes whole lines instead
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The child must import the package under test from this checkout, even when it is not installed.
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    startup = os.path.join(repo_root, "tests", "_launched")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, startup, env.get("PYTHONPATH", "")) if p)
    for name, value in (extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _start(cmd: list[str], env: dict[str, str], cwd: str | None, name: str, logdir: str):
    # Output goes to files, not pipes: a chatty rank can never block on a full pipe while its peer waits on it.
    out = open(os.path.join(logdir, f"{name}.out"), "w+", encoding="utf-8", errors="replace")  # noqa: SIM115
    err = open(os.path.join(logdir, f"{name}.err"), "w+", encoding="utf-8", errors="replace")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err, start_new_session=True)
    return proc, out, err


def _finish(procs, timeout: float) -> tuple[list[ProcessResult], bool]:
    """Wait for all processes within one shared deadline; kill every survivor when it passes."""
    deadline = time.monotonic() + timeout
    timed_out = False
    results = []
    for _name, proc, _out, _err in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for name, proc, out, err in procs:
        killed = proc.poll() is None
        if killed:
            try:
                os.killpg(proc.pid, 9)  # its own session: takes down the children it spawned, nothing else
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        results.append(ProcessResult(name, None if killed else proc.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results, timed_out


def run_ranks(
    script: str,
    args: Sequence[str] = (),
    *,
    world_size: int = 2,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> list[ProcessResult]:
    """Run ``world_size`` copies of ``script``, one per rank, rendezvousing on a free port of 127.0.0.1.

    Each copy gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Returns the
    results in rank order when every rank exits 0; otherwise raises :class:`LaunchError`.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="stagesafe-launch-") as logdir:
        procs = []
        for rank in range(world_size):
            rank_env = sanitized_env(env)
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            name = f"rank{rank}"
            procs.append((name, *_start([sys.executable, script, *args], rank_env, cwd, name, logdir)))
        results, timed_out = _finish(procs, timeout)
    if timed_out:
        raise LaunchError(f"{os.path.basename(script)} did not finish within {timeout:g} s", results)
    if any(r.returncode != 0 for r in results):
        raise LaunchError(f"{os.path.basename(script)} failed on at least one of {world_size} ranks", results)
    return results


def run_script(
    script: str,
    args: Sequence[str] = (),
    *,
    timeout: float = 120.0,
    env: Mapping[str, str | None] | None = None,
    cwd: str | None = None,
) -> ProcessResult:
    """Run ``python script args`` once (a script that spawns its own ranks, as Lightning does), sanitized env.

    Returns the result when it exits 0; otherwise raises :class:`LaunchError`. On timeout the whole process
    group is killed, including ranks the script spawned.
    """
    with tempfile.TemporaryDirectory(prefix="stagesafe-launch-") as logdir:
        procs = [("main", *_start([sys.executable, script, *args], sanitized_env(env), cwd, "main", logdir))]
        (result,), timed_out = _finish(procs, timeout)
    if timed_out:
        raise LaunchError(f"{os.path.basename(script)} did not finish within {timeout:g} s", [result])
    if result.returncode != 0:
        raise LaunchError(f"{os.path.basename(script)} failed", [result])
    return result


# -- real DeepSpeed checkpoints, shared by the test modules ------------------------------------------------------

# name -> spec for tests/scripts/make_zero_checkpoint.py: every ZeRO stage in fp32, bf16 for each stage, and
# Lightning's layout (trainer.save_checkpoint under DeepSpeedStrategy: tag "checkpoint" plus client state).
ZERO_CHECKPOINT_SPECS = (
    "s1:stage=1,dtype=fp32",
    "s2:stage=2,dtype=fp32",
    "s3:stage=3,dtype=fp32",
    "s1b:stage=1,dtype=bf16",
    "s2b:stage=2,dtype=bf16",
    "s3b:stage=3,dtype=bf16",
    "lit:stage=3,dtype=fp32,layout=lightning",
)


@functools.cache
def zero_checkpoints(
    root: str, specs: tuple[str, ...] = ZERO_CHECKPOINT_SPECS, *, world_size: int = 2, timeout: float = 240.0
) -> dict:
    """Build the checkpoints of ``specs`` under ``root`` with real DeepSpeed ranks (gloo, CPU), once per process.

    Returns ``{name: {"path", "stage", "dtype", "layout"}}``. One launch builds them all (about 8 s, plus about
    30 s the first time DeepSpeed compiles its shared-memory op, into the venv's folder: tests/conftest.py).
    """
    script = os.path.join(SCRIPTS, "make_zero_checkpoint.py")
    results = run_ranks(script, [root, *specs], world_size=world_size, timeout=timeout)
    done = [line for line in results[0].stdout.splitlines() if line.startswith("DONE ")]
    if not done:
        raise LaunchError("make_zero_checkpoint.py exited 0 without its DONE line", results)
    return {item["name"]: item for item in json.loads(done[-1][len("DONE ") :])}


def on_every_rank(fn: Callable[[int], object], world: int, *, timeout: float = 60) -> list:
    """Run ``fn(rank)`` in one thread per rank of this process; return each rank's result, or the exception
    it raised (a rank still running after ``timeout`` seconds fails the test)."""
    results: list = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - the test inspects each rank's outcome
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), name=f"test-rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"a rank is still running after {timeout} s"
    return results


def store_channels(world: int, *, timeout: float = 30.0, prefix: str = "t") -> list:
    """One :class:`~stagesafe.stages.channel.JobChannel` per rank on a real ``TCPStore`` on a free port: rank
    0's store serves, the others connect to it, as the ranks of a job do (rank ``r`` at index ``r``)."""
    import datetime

    import torch.distributed as dist

    from stagesafe.stages.channel import JobChannel

    wait = datetime.timedelta(seconds=max(timeout, 30.0))
    server = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False, timeout=wait)
    stores = [server] + [dist.TCPStore("127.0.0.1", server.port, world, False, timeout=wait) for _ in range(1, world)]
    return [JobChannel(store, rank=r, world=world, prefix=prefix, timeout=timeout) for r, store in enumerate(stores)]
# -- test functions on the ranks of a gloo process group, in this test run ------------------------------------


class GlooRanks:
    """``world_size`` spawned processes that stay up across tests (torch is imported once), each a rank of a
    fresh gloo process group for every :meth:`run` (a FileStore under ``folder``), so one test's broken
    collective cannot break the next test's.

    ``run(fn, *args)`` calls the module-level ``fn(*args)`` on every rank at once and returns, in rank order,
    what each returned, or the exception it raised (``KeyboardInterrupt`` too). A collective waits at most
    ``timeout`` seconds; a rank that gives no answer in about twice that fails the test, and the ranks are
    started afresh for the next call. The processes inherit this one's environment.
    """

    def __init__(self, folder: str, world_size: int = 2, *, timeout: float = 20.0) -> None:
        self.folder, self.world_size, self.timeout = folder, world_size, timeout
        self._context = multiprocessing.get_context("spawn")
        self._processes: list[Any] = []
        self._jobs: list[Any] = []
        self._answers: Any = None
        self._calls = 0

    def __enter__(self) -> "GlooRanks":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> None:
        self._answers = self._context.Queue()
        self._jobs = [self._context.Queue() for _ in range(self.world_size)]
        self._processes = [
            self._context.Process(
                target=_serve_rank, args=(r, self.world_size, self._jobs[r], self._answers), daemon=True
            )
            for r in range(self.world_size)
        ]
        for process in self._processes:
            process.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if not self._processes:
            self._start()
        self._calls += 1
        store = os.path.join(self.folder, f"store-{self._calls}")
        for jobs in self._jobs:
            jobs.put((store, self.timeout, fn, args))
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + 2 * self.timeout + 30  # the first call also waits for the imports
        while len(answers) < self.world_size:
            try:
                rank, answer = self._answers.get(timeout=1.0)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self._processes) if not p.is_alive()}
                if dead or time.monotonic() > deadline:
                    silent = sorted(set(range(self.world_size)) - set(answers))
                    self.close()
                    raise AssertionError(
                        f"{fn.__name__}: no answer from rank(s) {silent}" + (f"; exit codes {dead}" if dead else "")
                    ) from None
                continue
            answers[rank] = pickle.loads(answer)
        return [answers[r] for r in range(self.world_size)]

    def close(self) -> None:
        for jobs, process in zip(self._jobs, self._processes):
            if process.is_alive():
                jobs.put(None)
        for process in self._processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes, self._jobs = [], []


def _serve_rank(rank: int, world_size: int, jobs: Any, answers: Any) -> None:
    """One rank of :class:`GlooRanks`: a process group per job, the job's outcome pickled back."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    while (job := jobs.get()) is not None:
        path, timeout, fn, args = job
        store = dist.FileStore(path, world_size)
        store.set_timeout(timedelta(seconds=timeout))
        try:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
            try:
                outcome = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - an interrupt is an outcome the tests look at
                outcome = exc
            _meet(store, "ran", rank, world_size)  # no rank leaves the group while another may still use it
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the process group itself failed: the test is told
            outcome = exc
        _meet(store, "left", rank, world_size)  # nor joins the next one before every rank has left this one
        try:
            answer = pickle.dumps(outcome)
        except Exception as exc:  # noqa: BLE001 - said instead of lost
            answer = pickle.dumps(RuntimeError(f"rank {rank}: cannot send {outcome!r} back ({exc})"))
        answers.put((rank, answer))


def _meet(store: Any, name: str, rank: int, world_size: int) -> None:
    """Wait, through the store and at most its timeout, until every rank has reached ``name``."""
    store.set(f"{name}/{rank}", "1")
    try:
        store.wait([f"{name}/{r}" for r in range(world_size)])
    except Exception:  # noqa: BLE001 - a rank that does not come is the test's to report
        pass


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two gloo ranks for the tests of one module (import this fixture into it)."""
    with GlooRanks(str(tmp_path_factory.mktemp("gloo")), world_size=2) as ranks:
        yield ranks


def end_process_group() -> None:
    """Undo a test's in-process process group as the strategy does at exit, and DeepSpeed's copy of the world group
    (``groups._WORLD_GROUP``) where torch's was started directly: a later group in the same process would otherwise
    meet it as "not registered"."""
    from deepspeed.utils import groups

    from stagesafe.strategy_bases.process_groups_at_exit import end_process_groups

    end_process_groups()
    groups._WORLD_GROUP = None


def run_recorded(
    script: str, args: Sequence[str], *, timeout: float, cwd: str, expect_ok: bool = True
) -> tuple[list[ProcessResult], list[list[dict]]]:
    """Run a 2-rank job script whose ranks print ``RECORD {json}`` lines; returns the results and each rank's
    records, in order. ``expect_ok=False``: a rank that exits non-zero is a result, not a failure."""
    try:
        results = run_ranks(script, args, timeout=timeout, cwd=cwd)
    except LaunchError as failed:
        if expect_ok:
            raise
        results = failed.results
    records = [[json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RECORD ")] for r in results]
    return results, records
