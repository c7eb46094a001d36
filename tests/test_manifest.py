"""handoff/manifest.py, on plain data: the manifest built, checksummed and validated, the metadata checked."""

from __future__ import annotations

import copy
import hashlib

import pytest
from _pure import PURE, imports_of

import stagesafe.handoff.manifest
from stagesafe.handoff.digest import DEFAULT, NAMES, hash_buffer
from stagesafe.handoff.manifest import (
    FORMAT,
    build_manifest,
    check_metadata,
    digest_of,
    manifest_checksum,
    shard_digest,
    validate_manifest,
)
from stagesafe.errors import HandoffCorruptError, InvalidArgumentError


def test_it_imports_neither_torch_nor_fsspec():
    assert imports_of(stagesafe.handoff.manifest) <= PURE


def test_check_metadata_copies_plain_json():
    meta = {"stage": "fit", "global_step": 7, "epoch": 1, "lr": 0.5, "flags": (True, None), "nested": {"k": [1]}}
    out = check_metadata(meta)
    assert out == {"stage": "fit", "global_step": 7, "epoch": 1, "lr": 0.5, "flags": [True, None], "nested": {"k": [1]}}
    meta["nested"]["k"].append(2)
    assert out["nested"]["k"] == [1]
    assert check_metadata(None) == {}


@pytest.mark.parametrize(
    ("meta", "pattern"),
    [
        ({"s": {1, 2}}, r"metadata\['s'\] is a builtins.set"),
        ({"x": [1, object()]}, r"metadata\['x'\]\[1\]"),
        ({"loss": float("nan")}, r"metadata\['loss'\] is nan"),
        ({1: "a"}, "key 1 of type int"),
        ([("a", 1)], "must be a dict"),
    ],
)
def test_check_metadata_names_the_bad_entry(meta, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        check_metadata(meta)


SHARD = "model-00001-of-00001.safetensors"


def _manifest(digest=DEFAULT):
    return build_manifest(
        digest=digest,
        shards={SHARD: {"hexdigest": hash_buffer(digest, b"shard"), "size": 100}},
        weight_map={"w": SHARD},
        tensors={"w": {"dtype": "float32", "shape": (2, 3)}, "tied": {"dtype": "float32", "shape": [2, 3]}},
        aliases={"tied": "w"},
        total_size=24,
        metadata={"stage": "fit"},
        versions={"python": "3.11"},
        created="2026-01-01T00:00:00.000+00:00",
    )


def test_build_manifest():
    m = _manifest()
    assert m["format"] == FORMAT == "stagesafe/2"
    assert m["digest"] == DEFAULT and digest_of(m) == DEFAULT
    assert m["shards"][SHARD] == {DEFAULT: hash_buffer(DEFAULT, b"shard"), "size": 100}
    assert shard_digest(m, SHARD) == hash_buffer(DEFAULT, b"shard")
    assert m["tensors"]["w"]["shape"] == [2, 3]
    assert m["aliases"] == {"tied": "w"}
    assert validate_manifest(copy.deepcopy(m), source="x") == m


def test_a_sha256_manifest_is_written_as_before_so_older_readers_read_it():
    m = _manifest("sha256")
    assert m["format"] == "stagesafe/1" and "digest" not in m  # the layout every stagesafe before it wrote
    assert m["shards"][SHARD] == {"sha256": hashlib.sha256(b"shard").hexdigest(), "size": 100}
    assert digest_of(m) == "sha256" and validate_manifest(copy.deepcopy(m), source="x") == m


@pytest.mark.parametrize("digest", NAMES)
def test_every_digest_makes_a_manifest_that_validates(digest):
    m = _manifest(digest)
    assert digest_of(validate_manifest(copy.deepcopy(m), source="x")) == digest


def test_build_manifest_refuses_an_unknown_digest():
    with pytest.raises(InvalidArgumentError, match="digest='md5' is not one stagesafe knows; pass one of"):
        _manifest("md5")


def _break(path, value):
    def edit(m):
        target = m
        for key in path[:-1]:
            target = target[key]
        if value is KeyError:
            del target[path[-1]]
        else:
            target[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (_break(["format"], "other/1"), "'format' is 'other/1'"),
        (_break(["format"], "stagesafe/9"), "newer than this stagesafe reads.*upgrade stagesafe"),
        (_break(["digest"], "xxh4-512"), "digest 'xxh4-512' is not one this stagesafe knows.*upgrade stagesafe"),
        (_break(["digest"], KeyError), "'digest' is None, expected the name of the shards' digest"),
        (_break(["digest"], ["sha256"]), "'digest' is \\['sha256'\\]"),
        (_break(["format"], "stagesafe/1"), "format 'stagesafe/1' records sha256 and names no 'digest'"),
        (_break(["shards"], KeyError), "'shards' is missing"),
        (_break(["weight_map", "w"], "model-00009-of-00009.safetensors"), "not listed in 'shards'"),
        (_break(["aliases", "tied"], "nope"), "alias 'tied' points to 'nope'"),
        (_break(["shards", "../../etc/passwd"], {DEFAULT: "0" * 32, "size": 1}), "not a shard file name"),
        (_break(["shards", SHARD, DEFAULT], "xyz"), f"needs a hex '{DEFAULT}' of its bytes"),
        (_break(["shards", SHARD, DEFAULT], "0" * 64), f"needs a hex '{DEFAULT}' of its bytes"),
        (_break(["shards", SHARD, DEFAULT], "A" * 32), f"needs a hex '{DEFAULT}' of its bytes"),
        (_break(["shards", SHARD], {"sha256": "0" * 64, "size": 100}), f"needs a hex '{DEFAULT}' of its bytes"),
        (_break(["tensors", "extra"], {"dtype": "float32", "shape": [1]}), "only in 'tensors': \\['extra'\\]"),
        (_break(["tensors", "w", "shape"], [-1]), "tensor 'w' needs"),
    ],
)
def test_validate_manifest_refuses(edit, pattern):
    m = _manifest()
    edit(m)
    m["checksum"] = manifest_checksum(m)  # a consistent-looking manifest: the structural check must catch it
    with pytest.raises(HandoffCorruptError, match=pattern):
        validate_manifest(m, source="somewhere/stagesafe.json")
    with pytest.raises(HandoffCorruptError, match="somewhere"):
        validate_manifest(m, source="somewhere/stagesafe.json")


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (_break(["shards", SHARD, "sha256"], "0" * 63), "needs a hex 'sha256' of its bytes"),
        (_break(["shards", SHARD], {DEFAULT: "0" * 32, "size": 100}), "needs a hex 'sha256' of its bytes"),
        (_break(["format"], "stagesafe/2"), "'digest' is None"),
    ],
)
def test_validate_a_sha256_manifest_refuses(edit, pattern):
    m = _manifest("sha256")
    edit(m)
    m["checksum"] = manifest_checksum(m)
    with pytest.raises(HandoffCorruptError, match=pattern):
        validate_manifest(m, source="somewhere/stagesafe.json")


def test_a_manifest_changed_after_it_was_written_is_refused():
    m = _manifest()
    m["aliases"] = {}  # one table edited, checksum not recomputed
    with pytest.raises(HandoffCorruptError, match="'checksum' does not match its content"):
        validate_manifest(m, source="somewhere/stagesafe.json")


def test_validate_manifest_refuses_non_object():
    with pytest.raises(HandoffCorruptError, match="JSON list"):
        validate_manifest([], source="x")
