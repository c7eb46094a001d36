"""Manifests this process has already checked, by the sha256 of their exact bytes.

A save reads back the manifest it has just written several times (the index follows it, cleanup keeps its
shards, the next save replaces it), and each read parsed and validated every tensor's entry again: at 20,000
tensors, a few tenths of a second a read. Bytes found valid once are valid again, so a read of the same bytes
skips the validation, and a reader that needs only the shard names does not parse them at all.
sha256, not a faster hash: bytes crafted to collide with a valid manifest's must not skip its checks.
Pure: no torch, no fsspec.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

__all__ = ["key_of", "lookup", "remember"]

_KEEP = 8  # manifests remembered: a few folders, each with its last commit and the one it replaced

_known: OrderedDict[str, frozenset[str]] = OrderedDict()  # key -> the manifest's shard files
_lock = threading.Lock()


def key_of(raw: bytes | bytearray | memoryview) -> str:
    """The key of a manifest's bytes."""
    return hashlib.sha256(raw).hexdigest()


def lookup(key: str) -> frozenset[str] | None:
    """The shard files of the manifest whose bytes have ``key``, if they were found valid before."""
    with _lock:
        shards = _known.get(key)
        if shards is not None:
            _known.move_to_end(key)
        return shards


def remember(key: str, shards: frozenset[str]) -> None:
    """Record that the bytes of ``key`` are a valid manifest (validated, or written after validation) naming
    the shard files ``shards``."""
    with _lock:
        _known[key] = shards
        _known.move_to_end(key)
        while len(_known) > _KEEP:
            _known.popitem(last=False)
