"""Manifests this process has already checked, by the sha256 of their exact bytes.

A save reads back the manifest it has just written several times (the index follows it, cleanup keeps its
shards, the next save replaces it), and each read parsed and validated every tensor's entry again: at 20,000
tensors, a few tenths of a second a read. Bytes found valid once are valid again, so a read of the same bytes
skips the validation, and a reader that needs only the shard names or the index does not parse them at all.
sha256, not a faster hash: bytes crafted to collide with a valid manifest's must not skip its checks.
Pure: no torch, no fsspec.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["Known", "key_of", "lookup", "remember"]

_KEEP = 8  # manifests remembered: a few folders, each with its last commit and the one it replaced


@dataclass(frozen=True)
class Known:
    """What a valid manifest says that its readers here need without parsing it: its shard files, and the
    sha256 of the Hugging Face index it implies, as the commit writes it (None until a commit wrote one)."""

    shards: frozenset[str]
    index_sha256: str | None = None


_known: OrderedDict[str, Known] = OrderedDict()
_lock = threading.Lock()


def key_of(raw: bytes | bytearray | memoryview) -> str:
    """The key of a manifest's bytes."""
    return hashlib.sha256(raw).hexdigest()


def lookup(key: str) -> Known | None:
    """What is known of the manifest whose bytes have ``key``, if they were found valid before."""
    with _lock:
        known = _known.get(key)
        if known is not None:
            _known.move_to_end(key)
        return known


def remember(key: str, known: Known) -> None:
    """Record that the bytes of ``key`` are a valid manifest (validated, or written after validation)."""
    with _lock:
        previous = _known.get(key)
        if previous is not None and known.index_sha256 is None:
            known = previous  # a reader's look does not forget the index a commit recorded
        _known[key] = known
        _known.move_to_end(key)
        while len(_known) > _KEEP:
            _known.popitem(last=False)
