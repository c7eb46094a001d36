"""The names of a handoff's files: its shards (a tag of their own per commit), the index, the manifest, and the
temporary files its writers leave when killed, which its cleanup alone may delete.

Pure: what a name means is decided here only, so that other layers ask (``is_shard_name``, ``scratch_name``)
instead of matching names themselves.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable

from stagesafe.errors import InvalidArgumentError
from stagesafe.storage.temp_names import TEMP_SUFFIX, temp_name

__all__ = [
    "INDEX_NAME",
    "MANIFEST_NAME",
    "is_commit_of",
    "is_shard_name",
    "is_temp_name",
    "scratch_name",
    "shard_file_names",
    "tag_for",
]

INDEX_NAME = "model.safetensors.index.json"  # the name Hugging Face loaders look for
MANIFEST_NAME = "stagesafe.json"  # written last: its presence and content define the committed handoff

_SHARD_RE = re.compile(r"model-(?:[0-9a-f]{8}-)?\d{5,12}-of-\d{5,12}\.safetensors")  # 12: a name a disk can hold
# Only temporary files of our own names, so that a user's unrelated `x.tmp-1` in the folder is left alone.
_TEMP_RE = re.compile(
    r"(?:model-.*\.safetensors|" + re.escape(INDEX_NAME) + "|" + re.escape(MANIFEST_NAME) + ")" + TEMP_SUFFIX
)
_TAG_RE = re.compile(r"[0-9a-f]{8}")


def shard_file_names(n: int, *, tag: str | None = None, taken: Iterable[str] = ()) -> list[str]:
    """Hugging Face shard names for ``n`` shards of one commit: ``model-<tag>-00001-of-0000N.safetensors``.

    Every commit gets a tag of its own, so that no writer ever replaces a file that the committed handoff, or
    another writer's commit in progress, uses: two writers of one folder cannot mix their shards, and readers
    of the committed handoff keep reading it while the next one is written. ``tag`` (8 hex digits) fixes it
    (ranks writing shards of one handoff must agree on it); by default a random one is drawn, avoiding the
    names in ``taken``. Readers find the names in the index and the manifest; older handoffs' plain names
    (``model-00001-of-0000N.safetensors``) still read.
    """
    if tag is not None and not _TAG_RE.fullmatch(tag):
        raise InvalidArgumentError(f"tag={tag!r} must be 8 lower-case hex digits, e.g. {secrets.token_hex(4)!r}")
    taken = set(taken)
    while True:
        chosen = tag if tag is not None else secrets.token_hex(4)
        names = [f"model-{chosen}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        if taken.isdisjoint(names):
            return names
        if tag is not None:
            raise InvalidArgumentError(f"tag={tag!r} is used by the committed handoff's files; pick another tag")


def tag_for(key: str) -> str:
    """The shard-name tag every rank derives alike from a write's ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def is_commit_of(shard_files: Iterable[str], key: str) -> bool:
    """Whether a handoff whose shards are ``shard_files`` is the commit of the write keyed ``key`` (its shards
    carry that write's tag, :func:`tag_for`): is that write's commit the live one?"""
    prefix = f"model-{tag_for(key)}-"
    return any(name.startswith(prefix) for name in shard_files)


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is a shard file name this format writes (plain or generation-tagged)."""
    return _SHARD_RE.fullmatch(name) is not None


def scratch_name(token: str | None = None) -> str:
    """A file name in a handoff folder that is none of its files and that the handoff's own cleanup removes,
    should it be left behind: for a probe or a token written there before any handoff (``token``: hex)."""
    return temp_name(MANIFEST_NAME, token)


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temporary file of this format, e.g. left behind by a killed writer."""
    return _TEMP_RE.fullmatch(name) is not None
