"""A process that saves a large state dict as a handoff and dies, or fails, on the way.

Usage: python faulty_writer.py URL MODE [STORAGE_OPTIONS_JSON]

MODE:
- ``kill@<point>``: the process sends itself SIGKILL at ``<point>`` of the save, so no ``finally``, no
  ``except`` and no clean-up of stagesafe runs, as when the OOM killer or a preempted node stops a writer:
  ``mid_shard`` (shard 2's bytes are half written; shards written beside it in other threads wait for the
  death, so none completes), ``shard_written`` (shard 2 is in place, shard 3 is not written), ``index_written``
  (every shard and the new index are in place, the manifest is not), ``manifest_written`` (the new manifest is
  committed; the previous generation is not deleted yet).
- ``slow``: no fault; prints ``WRITING`` and saves, for a parent that kills it from outside at any moment.
- ``loop@<first>``: no fault; saves :func:`generation` ``first``, ``first + 1``, ... over each other, printing
  ``SAVED <n>`` after each, until a parent kills it from outside.
- ``fsize=<bytes>``: RLIMIT_FSIZE caps the size of any file this process writes (SIGXFSZ ignored, so writes
  fail with EFBIG, as on a full quota).
- ``nobody``: run as the unprivileged user ``nobody`` (when started as root; otherwise as is), so that a folder
  without write permission for that user refuses the save for real.

With ``fsize=`` and ``nobody`` the error the save raised is printed as one JSON line, ``ERROR {...}``.

The state dict is :func:`big_state_dict` (6 tensors of 16 MiB, 3 shards of 32 MiB), which the test rebuilds
to compare bit for bit.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading

import torch

from stagesafe import save_state_dict

from stagesafe.storage import folder
from stagesafe.handoff.names import INDEX_NAME, MANIFEST_NAME

NUMEL = 4 * 1024 * 1024  # float32 elements per tensor: 16 MiB
SHARD = "32MiB"


def big_state_dict(seed: int, n: int = 6, numel: int = NUMEL) -> dict[str, torch.Tensor]:
    """Distinct bytes per seed and tensor; every bit pattern (NaN payloads too) is a valid float32."""
    base = torch.arange(numel, dtype=torch.int32) * 2654435761
    return {f"layer{i}.weight": (base ^ (seed * 7919 + i)).view(torch.float32) for i in range(n)}


def generation(n: int) -> dict[str, torch.Tensor]:
    """Save number ``n`` of the ``loop`` mode: 3 small shards, every element of every tensor equal to ``n``."""
    return {f"layer{i}.weight": torch.full((2048,), float(n)) for i in range(3)}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_at(point: str) -> None:
    """Wrap the store's atomic write so that the process kills itself at ``point``."""
    real = folder.write_atomic
    shards_started: list[str] = []  # on an object store, shards are written by several threads at once
    shards_done: list[str] = []

    def chunks_then_die(data):
        for i, chunk in enumerate(data):
            yield chunk
            if i == 1:  # the header and the first tensor of the shard went out; the second has not
                _die()

    def held_until_death(data):
        # a shard written beside the dying one (several threads: an object store) must not complete first, or
        # it would be left as a whole object, young, that no later save may delete yet
        threading.Event().wait(60)
        yield from data

    def write_atomic(fs, path, data):
        name = path.rsplit("/", 1)[-1]
        is_shard = name not in (INDEX_NAME, MANIFEST_NAME)
        if is_shard:
            shards_started.append(name)
        if point == "mid_shard" and is_shard and len(shards_started) == 2:
            real(fs, path, chunks_then_die(data))
            raise AssertionError("unreachable: the writer should be dead")
        if point == "mid_shard" and is_shard and threading.current_thread() is not threading.main_thread():
            data = held_until_death(data)
        real(fs, path, data)
        if is_shard:
            shards_done.append(name)
        if (
            (point == "shard_written" and is_shard and len(shards_done) == 2)
            or (point == "index_written" and name == INDEX_NAME)
            or (point == "manifest_written" and name == MANIFEST_NAME)
        ):
            _die()

    folder.write_atomic = write_atomic


def main() -> None:
    url, mode = sys.argv[1], sys.argv[2]
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    state = big_state_dict(seed=2)
    if mode.startswith("kill@"):
        _kill_at(mode.removeprefix("kill@"))
    elif mode == "slow":
        print("WRITING", flush=True)
    elif mode.startswith("loop@"):
        print("WRITING", flush=True)
        n = int(mode.removeprefix("loop@"))
        while True:
            save_state_dict(generation(n), url, max_shard_size="8KB", storage_options=options, overwrite=True)
            print(f"SAVED {n}", flush=True)
            n += 1
    elif mode.startswith("fsize=") or mode == "nobody":
        if mode == "nobody":
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
        else:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            limit = int(mode.removeprefix("fsize="))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            save_state_dict(state, url, max_shard_size=SHARD, storage_options=options, overwrite=True)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            error = {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
            print("ERROR " + json.dumps(error), flush=True)
            return
        print("SAVED", flush=True)
        return
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    save_state_dict(state, url, max_shard_size=SHARD, storage_options=options, overwrite=True)
    print("SAVED", flush=True)


if __name__ == "__main__":
    main()
