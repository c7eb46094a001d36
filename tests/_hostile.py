"""Crafting hostile files as an attacker who knows the formats would, and watching what a reader opens.

Shared by the tests of the readers and by ``benchmarks/fuzz_hostile.py``: safetensors files with any header,
handoffs whose manifest is forged to match them (its checksum recomputed), FIFOs and symbolic links in place of
files, and an audit hook that records every file the process opens, so that a test can assert that nothing
outside a folder was opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
INDEX, MANIFEST = "model.safetensors.index.json", "stagesafe.json"

__all__ = [
    "INDEX",
    "MANIFEST",
    "forge_manifest",
    "opened_files",
    "replace_shard",
    "run_python",
    "safetensors_bytes",
]


def safetensors_bytes(header: Any = None, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    """A safetensors file: its 8-byte length, the header (``raw`` bytes, or ``header`` as JSON) padded to 8, then
    ``data``."""
    text = raw if raw is not None else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def forge_manifest(root: str, edit: Callable[[dict], None]) -> dict:
    """Change the manifest of the local handoff ``root`` with ``edit`` and make its checksum match again, as an
    attacker who read the format would; the index gets the same weight map."""
    from stagesafe.handoff.plan import manifest_checksum

    path = os.path.join(root, MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    edit(manifest)
    manifest["checksum"] = manifest_checksum(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)
    with open(os.path.join(root, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": manifest["total_size"]}, "weight_map": manifest["weight_map"]}, f)
    return manifest


def replace_shard(root: str, data: bytes, tensors: Mapping[str, tuple[str, list[int]]] | None = None) -> str:
    """Make ``data`` the only shard of the local handoff ``root``, with a manifest forged to match it: its size
    and sha256, and ``tensors`` (name -> (dtype, shape)) stored in it. Returns the shard's name."""
    with open(os.path.join(root, MANIFEST)) as f:
        (shard,) = json.load(f)["shards"]
    with open(os.path.join(root, shard), "wb") as f:
        f.write(data)

    def edit(manifest: dict) -> None:
        manifest["shards"][shard] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        if tensors is not None:
            manifest["tensors"] = {name: {"dtype": d, "shape": list(s)} for name, (d, s) in tensors.items()}
            manifest["weight_map"] = {name: shard for name in tensors}
            manifest["aliases"] = {}

    forge_manifest(root, edit)
    return shard


# -- what the process opens ------------------------------------------------------------------------------------------

_recording: list[list[str]] = []
_lock = threading.Lock()
_hooked = False


def _hook(event: str, args: tuple) -> None:
    if event == "open" and _recording and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        with _lock:
            for paths in _recording:
                paths.append(path)


@contextlib.contextmanager
def opened_files() -> Iterator[list[str]]:
    """Record the path of every file opened (``open``, ``os.open``, ``io.open``) while the block runs."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_hook)  # once per process: a hook cannot be removed
        _hooked = True
    paths: list[str] = []
    with _lock:
        _recording.append(paths)
    try:
        yield paths
    finally:
        with _lock:
            _recording.remove(paths)


def outside(paths: list[str], folder: str) -> list[str]:
    """The paths, symbolic links followed, that do not lie inside ``folder``."""
    real = os.path.realpath(folder)
    return [p for p in paths if os.path.commonpath([real, os.path.realpath(p)]) != real]


# -- a reader in a process of its own ----------------------------------------------------------------------------


def run_python(code: str, *, timeout: float = 120, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that imports this checkout, with a timeout: a reader that crashes
    (SIGSEGV, SIGBUS) or hangs fails the test instead of taking pytest down with it. The timeout kills it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, HERE]))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
