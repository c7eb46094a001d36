"""The handoff format's pure rules, on plain data: sizes, shard plans, names, index, manifest."""

from __future__ import annotations

import ast
import copy
import hashlib
import pathlib

import pytest

import stagesafe.handoff.codec
import stagesafe.handoff.manifest
from stagesafe.handoff.digest import DEFAULT, NAMES, hash_buffer
from stagesafe.handoff.manifest import (
    FORMAT,
    build_index,
    build_manifest,
    check_metadata,
    digest_of,
    is_shard_name,
    is_temp_name,
    manifest_checksum,
    parse_size,
    plan_shards,
    shard_digest,
    shard_file_names,
    scratch_name,
    tag_for,
    validate_manifest,
)
from stagesafe.storage.temp_names import temp_name
from stagesafe.errors import HandoffCorruptError, InvalidArgumentError


@pytest.mark.parametrize("module", [stagesafe.handoff.manifest, stagesafe.handoff.codec], ids=["manifest", "codec"])
def test_pure_module_imports_neither_torch_nor_fsspec(module):
    # Read the source rather than sys.modules: the package's __init__ may import torch for its own reasons.
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {m.split(".")[0] for m in imported} <= {
        "__future__",
        "collections",
        "dataclasses",
        "decimal",
        "hashlib",
        "json",
        "math",
        "re",
        "secrets",
        "typing",
        "stagesafe",
    }
    assert {m for m in imported if m.startswith("stagesafe")} <= {
        "stagesafe.errors",
        "stagesafe.handoff.codec",
        "stagesafe.handoff.digest",  # pure as well: tests/test_digest.py
        "stagesafe.storage.temp_names",  # pure as well: tests/test_temp_names.py
    }


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1),
        (123456, 123456),
        ("100", 100),
        ("100B", 100),
        ("5KB", 5_000),
        ("500MB", 500_000_000),
        ("5GB", 5_000_000_000),
        ("2TB", 2_000_000_000_000),
        ("5gb", 5_000_000_000),
        (" 5 GB ", 5_000_000_000),
        ("10KiB", 10_240),
        ("3MiB", 3 * 1024**2),
        ("1.5GiB", 1_610_612_736),
        ("0.5KB", 500),
        ("1.1TB", 1_100_000_000_000),
    ],
)
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["5XB", "", "GB", "-1GB", "1.2.3GB", "1e9", "0", 0, -5, True, 1.5, None, "0.1B"])
def test_parse_size_refuses_with_the_value_named(value):
    with pytest.raises(InvalidArgumentError, match="max_shard_size") as info:
        parse_size(value)
    assert repr(value) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_plan_shards_greedy_in_order_like_huggingface():
    entries = [("a", 10), ("b", 10), ("c", 10), ("d", 25), ("e", 5), ("f", 5)]
    assert plan_shards(entries, 20) == [["a", "b"], ["c"], ["d"], ["e", "f"]]


def test_plan_shards_exact_fit_and_oversized_tensor_alone():
    assert plan_shards([("a", 10), ("b", 10)], 20) == [["a", "b"]]
    assert plan_shards([("a", 1), ("big", 100), ("c", 1)], 10) == [["a"], ["big"], ["c"]]
    assert plan_shards([("big", 100)], 10) == [["big"]]


def test_plan_shards_zero_size_and_empty():
    assert plan_shards([("a", 10), ("empty", 0), ("b", 0)], 10) == [["a", "empty", "b"]]
    assert plan_shards([], 10) == []
    with pytest.raises(InvalidArgumentError):
        plan_shards([("a", 1)], 0)


def test_shard_file_names_are_huggingface_names_with_a_tag_of_their_own_commit():
    names = shard_file_names(3)
    tag = names[0].split("-")[1]
    assert len(tag) == 8 and int(tag, 16) >= 0
    assert names == [f"model-{tag}-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert all(is_shard_name(n) for n in names)
    assert shard_file_names(0) == []
    # Every commit draws a tag of its own, avoiding the names it is told are taken; ranks given one tag agree.
    assert shard_file_names(3, taken=set(names))[0] != names[0]
    assert shard_file_names(2, tag="0badcafe") == ["model-0badcafe-00001-of-00002.safetensors",
                                                   "model-0badcafe-00002-of-00002.safetensors"]
    # Older handoffs' plain names still read.
    assert is_shard_name("model-00001-of-00002.safetensors")


def test_every_rank_derives_the_same_tag_from_a_writes_key():
    assert tag_for("stagesafe/ab12/write-1") == tag_for("stagesafe/ab12/write-1") != tag_for("stagesafe/ab12/write-2")
    assert len(tag_for("x")) == 8 and int(tag_for("x"), 16) >= 0


def test_shard_file_names_refuse_bad_or_taken_tag():
    taken = {"model-00001-of-00001.safetensors", "model-0badcafe-00001-of-00001.safetensors"}
    with pytest.raises(InvalidArgumentError, match="0badcafe"):
        shard_file_names(1, taken=taken, tag="0badcafe")
    with pytest.raises(InvalidArgumentError, match="'XYZ'"):
        shard_file_names(1, taken=taken, tag="XYZ")


def test_name_patterns():
    assert is_shard_name("model-00001-of-00003.safetensors")
    assert is_shard_name("model-deadbeef-00001-of-00003.safetensors")
    assert not is_shard_name("model.safetensors")
    assert not is_shard_name("../model-00001-of-00003.safetensors")
    assert not is_shard_name("model-00001-of-00003.safetensors.tmp-1234abcd")
    assert is_temp_name(temp_name("model-00001-of-00003.safetensors"))
    assert is_temp_name("stagesafe.json.tmp-deadbeef")
    assert is_temp_name("model.safetensors.index.json.tmp-0")
    assert not is_temp_name("notes.txt.tmp-deadbeef")  # not ours: left alone
    assert is_temp_name(scratch_name()) and is_temp_name(scratch_name("0123abcd"))  # a probe the cleanup removes
    assert scratch_name("0123abcd") != scratch_name("4567cdef") and not is_shard_name(scratch_name())


def test_build_index_is_huggingface_layout():
    index = build_index({"a": "model-00001-of-00001.safetensors"}, 40)
    assert index == {"metadata": {"total_size": 40}, "weight_map": {"a": "model-00001-of-00001.safetensors"}}


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
