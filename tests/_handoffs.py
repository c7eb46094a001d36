"""Handoff folders for the tests of the handoff modules: a location of each kind (plain path, file:// URL,
memory://), the files in it, their age, and the small handoffs and damages the tests of several modules share."""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timedelta, timezone

import fsspec
import pytest
import torch

from stagesafe.handoff.digest import DEFAULT
from stagesafe.storage.fs import list_files, resolve
from stagesafe.publishing.save import save_state_dict

INDEX, MANIFEST = "model.safetensors.index.json", "stagesafe.json"

__all__ = [
    "INDEX",
    "MANIFEST",
    "age",
    "big_url",
    "files",
    "flip_byte",
    "model_dict",
    "read",
    "remove_shard",
    "three_shards",
    "truncate",
    "two_handoffs",
    "url",
    "write",
]


@pytest.fixture(params=["path", "file_url", "memory"])
def url(request, tmp_path):
    """A handoff location of each kind; the folder does not exist yet."""
    if request.param == "path":
        yield str(tmp_path / "handoff")
    elif request.param == "file_url":
        yield f"file://{tmp_path}/handoff"
    else:
        root = f"/stagesafe-tests/{uuid.uuid4().hex}"
        yield f"memory://{root}"
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)


@pytest.fixture(params=["path", "memory"])
def big_url(request, tmp_path):
    """A local and a remote handoff location, for shards of tens of MB."""
    if request.param == "path":
        yield str(tmp_path / "handoff")
    else:
        root = f"/stagesafe-tests/{uuid.uuid4().hex}"
        yield f"memory://{root}"
        fsspec.filesystem("memory").rm(root, recursive=True)


def files(url: str) -> set[str]:
    fs, root = resolve(url)
    return set(list_files(fs, root))


def age(url: str, name: str, seconds: float) -> None:
    """Make a file look ``seconds`` old, as the filesystem reports it."""
    fs, root = resolve(url)
    path = f"{root}/{name}"
    when = datetime.now(timezone.utc) - timedelta(seconds=seconds)
    if fs.protocol == "memory" or "memory" in fs.protocol:
        fs.store[path].created = when
    else:
        os.utime(path, (when.timestamp(), when.timestamp()))


def read(url: str, name: str) -> bytes:
    fs, root = resolve(url)
    return fs.cat_file(f"{root}/{name}")


def write(url: str, name: str, data: bytes) -> None:
    fs, root = resolve(url)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/{name}", data)


def model_dict(seed: int, n: int = 6, numel: int = 100) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)}


def three_shards(url):
    """A handoff of three shards at ``url`` (replacing what is there): its state dict and its shard names."""
    sd = model_dict(5, n=6)
    manifest = save_state_dict(sd, url, max_shard_size=800, overwrite=True)
    return sd, list(manifest["shards"])


def flip_byte(url, shard):
    """Change one byte of a shard's tensor data; return what a reader says of it."""
    data = bytearray(read(url, shard))
    data[len(data) - 7] ^= 0xFF  # inside the tensor data: safetensors alone would not notice
    write(url, shard, bytes(data))
    return f"has {DEFAULT}"


def truncate(url, shard):
    """Cut the end of a shard; return what a reader says of it."""
    write(url, shard, read(url, shard)[:-10])
    return "bytes, the manifest says"


def remove_shard(url, shard):
    """Delete a shard; return what a reader says of it."""
    fs, root = resolve(url)
    fs.rm_file(f"{root}/{shard}")
    return "missing"


def two_handoffs(tmp_path):
    """Handoffs ``h`` and ``other`` side by side, of the same state dict: byte for byte the same shards."""
    sd = {"w": torch.arange(6.0)}
    (shard,) = save_state_dict(sd, str(tmp_path / "h"))["shards"]
    (theirs,) = save_state_dict(sd, str(tmp_path / "other"))["shards"]
    os.rename(tmp_path / "other" / theirs, tmp_path / "other" / shard)  # the same name in both folders
    return tmp_path / "h", tmp_path / "other", shard
