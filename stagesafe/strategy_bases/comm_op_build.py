"""DeepSpeed's CPU comm op, which torch builds the first time a process starts DeepSpeed's comm backend in an
environment: where it is built, and a watch that says so whenever a build happens, missing or stale.

torch (``cpp_extension.load``) takes the folder's ``lock`` file, writes ``build.ninja`` and runs ninja in every
process; ninja rebuilds when the library is missing or out of date for this environment (another venv's torch or
python in ``build.ninja``, another ninja's log, another DeepSpeed). An up-to-date run holds the lock for a moment;
a build holds it for 30 s to minutes, with nothing printed. So the watch says, at once, that a missing library
is being built, and, once the lock has been held longer than an up-to-date run takes, that a stale one is being
rebuilt and why it may be; a lock already there at the start (another process building, or one that was killed
while building, which nothing will end) is named too.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["COMM_OP", "comm_op_folder", "watch_comm_op_build"]

COMM_OP = "deepspeed_shm_comm"  # the name DeepSpeed's ShareMemCommBuilder builds under
_TAKES = "30 s to a few minutes with g++ and ninja; 38 s on 2 idle cores"
_ONE_FOLDER = "docs/troubleshooting.md#comm-op-build says how to keep one build per environment"


def comm_op_folder() -> str:
    """Where torch builds (and finds) DeepSpeed's CPU comm op: torch's rule for JIT extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        import torch
        from torch.utils.cpp_extension import get_default_build_root

        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return os.path.join(root, COMM_OP)


@contextlib.contextmanager
def watch_comm_op_build(
    say: Callable[[str], None], *, folder: str | None = None, after: float = 5.0, poll: float = 0.25
) -> Iterator[None]:
    """Around the start of DeepSpeed's comm backend: ``say`` (one line) when the op is built in ``folder``. A
    missing library is said at once; a build of an existing one once the lock has been held ``after`` seconds
    (an up-to-date run holds it far less); a lock older than the watch, once it has lasted ``after`` seconds."""
    folder = folder if folder is not None else comm_op_folder()
    library = os.path.join(folder, f"{COMM_OP}.so")
    if not os.path.isfile(library):
        say(f"stagesafe: DeepSpeed is building its CPU comm op in {folder}: it is not built there yet ({_TAKES}; "
            f"once per environment: {_ONE_FOLDER})")
        yield
        return
    started = time.time()
    done = threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(folder, say, started, after, poll, done), name="stagesafe-comm-op-build", daemon=True
    )
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _watch(folder: str, say: Callable[[str], None], started: float, after: float, poll: float,
           done: threading.Event) -> None:
    lock = os.path.join(folder, "lock")
    held_since: float | None = None
    while not done.wait(poll):
        try:
            made = os.stat(lock).st_mtime
        except OSError:
            held_since = None
            continue
        now = time.monotonic()
        held_since = now if held_since is None else held_since
        if now - held_since < after:
            continue
        if made < started - 1.0:  # there before this process looked (a second of slack for file times)
            say(f"stagesafe: waiting for {lock}, made at {time.strftime('%H:%M:%S', time.localtime(made))}: "
                "another process is building DeepSpeed's CPU comm op there, or one was killed while building it; "
                "in that case nothing ends the wait: delete the lock file (no build running) and start again")
        else:
            say(f"stagesafe: DeepSpeed is rebuilding its CPU comm op in {folder}: the library there is out of date "
                f"for this environment ({_stale_because(folder)}; {_TAKES}; {_ONE_FOLDER})")
        return


def _stale_because(folder: str) -> str:
    """Why the build there may not fit this process: the torch its build.ninja names, the ninja on PATH."""
    reasons = []
    try:
        with open(os.path.join(folder, "build.ninja"), encoding="utf-8") as f:
            built = re.search(r"-isystem (\S+)/torch/include ", f.read())
    except OSError:
        built = None
    import torch

    here = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    if built is not None and os.path.realpath(built.group(1)) != os.path.realpath(here):
        reasons.append(f"it was built against the torch in {built.group(1)}, this process uses {here}")
    reasons.append(f"ninja here is {shutil.which('ninja') or 'not on PATH'}; a build by another ninja, another "
                   "Python environment or another DeepSpeed is redone")
    return "; ".join(reasons)
