"""Crafting hostile files as an attacker who knows the formats would, and watching what a reader opens.

Shared by the tests of the readers and by ``benchmarks/fuzz_hostile.py``: safetensors files with any header,
handoffs whose manifest is forged to match them (its checksum recomputed), FIFOs and symbolic links in place of
files, and an audit hook that records every file the process opens, so that a test can assert that nothing
outside a folder was opened.
"""

from __future__ import annotations

import contextlib
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
    "outside",
    "replace_shard",
    "run_python",
    "safetensors_bytes",
    "write_zero_checkpoint",
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
    and digest, and ``tensors`` (name -> (dtype, shape)) stored in it. Returns the shard's name."""
    with open(os.path.join(root, MANIFEST)) as f:
        (shard,) = json.load(f)["shards"]
    with open(os.path.join(root, shard), "wb") as f:
        f.write(data)

    from stagesafe.handoff.digest import hash_buffer
    from stagesafe.handoff.plan import digest_of

    def edit(manifest: dict) -> None:
        manifest["shards"][shard] = {digest_of(manifest): hash_buffer(digest_of(manifest), data), "size": len(data)}
        if tensors is not None:
            manifest["tensors"] = {name: {"dtype": d, "shape": list(s)} for name, (d, s) in tensors.items()}
            manifest["weight_map"] = {name: shard for name in tensors}
            manifest["aliases"] = {}

    forge_manifest(root, edit)
    return shard


# -- DeepSpeed checkpoints, laid out as DeepSpeed does, without DeepSpeed ------------------------------------------


def write_zero_checkpoint(
    folder: str,
    params: Mapping[str, Any],
    *,
    stage: int = 3,
    world_size: int = 2,
    buffers: Mapping[str, Any] | None = None,
    tag: str = "global_step1",
    edit: Callable[[str, int, dict], None] | None = None,
) -> str:
    """Write a ZeRO checkpoint of fp32 ``params`` (and ``buffers``) at ``folder`` in DeepSpeed's layout: ``latest``
    naming ``tag``, and per rank an optimizer file with the rank's partition of the flat fp32 masters and model
    states (ZeRO-3: one per rank; ZeRO-1/2: ``mp_rank_00_model_states.pt``). ``edit(kind, rank, states)``
    (``kind`` "optim" or "model") may change what is saved, as an attacker would. Returns ``folder``."""
    import math
    from collections import OrderedDict

    import torch

    buffers = dict(buffers or {})
    tag_dir = os.path.join(folder, tag)
    os.makedirs(tag_dir, exist_ok=True)
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write(tag)
    shapes = OrderedDict((name, torch.Size(t.shape)) for name, t in params.items())
    values = [t.detach().reshape(-1).float() for t in params.values()]
    if stage == 3:  # each param split in world_size parts of ceil(numel / world_size), padded with zeros
        parts: list[list] = [[] for _ in range(world_size)]
        for v in values:
            part = math.ceil(v.numel() / world_size)
            padded = torch.cat([v, torch.zeros(part * world_size - v.numel())])
            for rank in range(world_size):
                parts[rank].append(padded[rank * part : (rank + 1) * part])
        flats = [torch.cat(p) if p else torch.empty(0) for p in parts]
    else:  # one group: every param in order, padded to a multiple of 2 * world_size, cut in world_size parts
        joined = torch.cat(values) if values else torch.empty(0)
        total = math.ceil(joined.numel() / (2 * world_size)) * 2 * world_size
        joined = torch.cat([joined, torch.zeros(total - joined.numel())])
        flats = list(joined.split(total // world_size)) if total else [torch.empty(0)] * world_size
    groups_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    module = OrderedDict((name, t.clone()) for name, t in buffers.items())
    if stage < 3:
        module.update((name, t.detach().clone()) for name, t in params.items())
    for rank in range(world_size):
        optim = {
            "optimizer_state_dict": {
                "zero_stage": stage,
                "partition_count": world_size if stage == 3 else [world_size],
                groups_key: [flats[rank].clone()],
                "exp_avg": [torch.zeros_like(flats[rank])],
            },
            "ds_version": "0.19.8",
        }
        if edit is not None:
            edit("optim", rank, optim)
        torch.save(optim, os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        if stage == 3 or rank == 0:
            model = {
                "module": OrderedDict(module),
                "buffer_names": list(buffers),
                "param_shapes": [OrderedDict(shapes)],
                "frozen_param_shapes": None,
                "shared_params": {},
                "ds_version": "0.19.8",
                "global_steps": 1,
            }
            if edit is not None:
                edit("model", rank, model)
            name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
            torch.save(model, os.path.join(tag_dir, name))
    return folder


# -- what the process opens ------------------------------------------------------------------------------------------

_recorders: list[tuple[Callable[[str, tuple], str | None], list[str]]] = []
_lock = threading.Lock()
_hooked = False


def _hook(event: str, args: tuple) -> None:
    if _recorders:
        with _lock:
            for keep, into in _recorders:
                kept = keep(event, args)
                if kept is not None:
                    into.append(kept)


@contextlib.contextmanager
def _recording(keep: Callable[[str, tuple], str | None]) -> Iterator[list[str]]:
    """What ``keep`` makes of each audit event raised while the block runs (``None``: nothing). One audit hook
    serves every recorder: a hook cannot be removed."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_hook)
        _hooked = True
    found: list[str] = []
    with _lock:
        _recorders.append((keep, found))
    try:
        yield found
    finally:
        with _lock:
            _recorders.remove((keep, found))


def _opened_path(event: str, args: tuple) -> str | None:
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        return os.fsdecode(args[0])
    return None


def opened_files() -> contextlib.AbstractContextManager[list[str]]:
    """Record the path of every file opened (``open``, ``os.open``, ``io.open``) while the block runs."""
    return _recording(_opened_path)


def audit_events() -> contextlib.AbstractContextManager[list[str]]:
    """Record every audit event the process raises while the block runs (``os.system``, ``exec``, ``import``,
    ``open``, ``subprocess.Popen``, ...): what running code a file names would show."""
    return _recording(lambda event, args: event)



def outside(paths: list[str], folder: str) -> list[str]:
    """The paths, symbolic links followed, that do not lie inside ``folder``."""
    real = os.path.realpath(folder)
    return [p for p in paths if os.path.commonpath([real, os.path.realpath(p)]) != real]


# -- a reader in a process of its own ----------------------------------------------------------------------------


def run_python(
    code: str,
    *args: str,
    timeout: float = 120,
    memory: int | None = None,
    file_size: int | None = None,
) -> subprocess.CompletedProcess:
    """Run ``code`` (with ``args`` as ``sys.argv[1:]``) in a fresh interpreter that imports this checkout, with a
    timeout: a reader that crashes (SIGSEGV, SIGBUS), hangs or eats memory fails the test instead of taking
    pytest down with it. ``memory`` caps its address space, ``file_size`` the files it writes (RLIMIT_FSIZE;
    Python ignores SIGXFSZ, so a write past it fails with EFBIG)."""
    import resource

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, HERE]))

    def limits() -> None:
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        if file_size is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        preexec_fn=limits,
    )
