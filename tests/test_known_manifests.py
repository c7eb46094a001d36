"""handoff/known_manifests.py: manifests this process has already checked, keyed by the sha256 of their bytes.
Pure data in, pure data out."""

from __future__ import annotations

import hashlib
import secrets

from stagesafe.handoff.known_manifests import key_of, lookup, remember


def test_the_key_is_the_sha256_of_the_exact_bytes_whatever_buffer_holds_them():
    raw = b'{"format": "stagesafe/2"}'
    assert key_of(raw) == hashlib.sha256(raw).hexdigest()
    assert key_of(bytearray(raw)) == key_of(memoryview(raw)) == key_of(raw)
    assert key_of(raw + b" ") != key_of(raw)  # one byte more: another manifest, checked again


def test_bytes_remembered_give_their_shards_and_unknown_bytes_give_none():
    raw = secrets.token_bytes(32)  # bytes no other test remembers
    key = key_of(raw)
    assert lookup(key) is None
    remember(key, frozenset({"model-abc-00001-of-00001.safetensors"}))
    assert lookup(key) == frozenset({"model-abc-00001-of-00001.safetensors"})
    assert lookup(key_of(raw[:-1])) is None
