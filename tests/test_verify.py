"""verify: every shard re-hashed and checked as a load checks it, the index against the manifest; damaged,
forged and hostile handoffs refused by verify and by a load alike."""

from __future__ import annotations

import json

import pytest
import torch
from _handoffs import (
    INDEX,
    MANIFEST,
    big_url,
    flip_byte,
    model_dict,
    read,
    remove_shard,
    three_shards,
    truncate,
    two_handoffs,
    url,
    write,
)
from _hostile import opened_files, outside, replace_shard, run_python, safetensors_bytes
from _tensors import assert_bitwise_equal

from stagesafe.errors import HandoffCorruptError
from stagesafe.handoff.digest import CHUNK, DEFAULT, LEAF, NAMES
from stagesafe.storage.fs import resolve
from stagesafe.handoff.manifest import digest_of, manifest_checksum
from stagesafe.handoff.read import load_state_dict
from stagesafe.publishing.save import save_state_dict
from stagesafe.publishing.verify import verify


@pytest.mark.parametrize("damage", [flip_byte, truncate, remove_shard])
def test_damaged_shards_are_refused_by_verify_and_load(url, damage):
    _, shards = three_shards(url)
    expected = damage(url, shards[1])
    for reader in (verify, load_state_dict):
        with pytest.raises(HandoffCorruptError, match=expected) as info:
            reader(url)
        assert repr(shards[1]) in str(info.value)


def test_weight_map_disagreeing_with_a_shard_is_refused_by_verify_and_load(url):
    _, shards = three_shards(url)
    manifest = json.loads(read(url, MANIFEST))
    moved = next(name for name, file in manifest["weight_map"].items() if file == shards[1])
    for doc, name in ((manifest, MANIFEST), (json.loads(read(url, INDEX)), INDEX)):  # index too: it agrees
        doc["weight_map"][moved] = shards[0]
        if name == MANIFEST:
            doc["checksum"] = manifest_checksum(doc)  # a forged, self-consistent manifest: the shard check catches it
        write(url, name, json.dumps(doc).encode())
    for reader in (verify, load_state_dict):
        with pytest.raises(HandoffCorruptError, match="disagrees with the manifest's weight_map") as info:
            reader(url)
        assert repr(shards[0]) in str(info.value) and moved in str(info.value)


def test_an_index_disagreeing_with_the_manifest_fails_verify_but_not_load(url):
    sd, shards = three_shards(url)
    index = json.loads(read(url, INDEX))
    index["weight_map"]["layer0.weight"] = shards[2]
    write(url, INDEX, json.dumps(index).encode())
    with pytest.raises(HandoffCorruptError, match=f"in another shard, e.g. 'layer0.weight' in '{shards[2]}'"):
        verify(url)
    assert_bitwise_equal(load_state_dict(url), sd)  # the manifest, not the index, defines the handoff


@pytest.mark.parametrize("workers", [1, 3])
def test_parallel_transfers_round_trip_and_name_the_first_damaged_shard(url, workers):
    sd = model_dict(7, n=8)
    manifest = save_state_dict(sd, url, max_shard_size=400, workers=workers)
    shards = list(manifest["shards"])
    assert len(shards) == 8
    assert_bitwise_equal(load_state_dict(url, workers=workers), sd)
    assert verify(url, workers=workers) == manifest
    for name in (shards[6], shards[2]):
        flip_byte(url, name)
    for reader in (verify, load_state_dict):  # the same shard as a loop over the shards would name
        with pytest.raises(HandoffCorruptError, match=f"shard '{shards[2]}' has {DEFAULT}"):
            reader(url, workers=workers)


@pytest.mark.slow  # 40 MB shards, every digest: seconds each
@pytest.mark.parametrize("digest", NAMES)
def test_a_flipped_byte_in_any_chunk_of_a_shard_is_caught_with_every_digest(big_url, digest):
    """One shard of 40 MB: two chunks as readers read it (32 MiB), ten pieces of xxh3-128-tree (4 MiB)."""
    sd = {"w": torch.randn(10_000_000, generator=torch.Generator().manual_seed(0))}
    manifest = save_state_dict(sd, big_url, digest=digest)
    assert digest_of(manifest) == digest
    (shard,) = manifest["shards"]
    fs, root = resolve(big_url)
    path = f"{root}/{shard}"
    size = manifest["shards"][shard]["size"]
    for at in (30, LEAF - 1, LEAF, CHUNK, CHUNK + LEAF + 7, size - 1):  # the header, pieces and chunks, their edges
        data = bytearray(fs.cat_file(path))
        data[at] ^= 0x10
        fs.pipe_file(path, bytes(data))  # in place on a local disk: same inode, new times
        for reader in (verify, load_state_dict):
            with pytest.raises(HandoffCorruptError, match=f"shard '{shard}' has {digest} "):
                reader(big_url)
        data[at] ^= 0x10
        fs.pipe_file(path, bytes(data))
    assert verify(big_url) == manifest
    assert_bitwise_equal(load_state_dict(big_url), sd)


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# A shard whose header safetensors refuses, with a manifest forged to match it (hash, size, tensors): the
# header's own checks are all that stands in the way.
FORGED_SHARDS = {
    "offsets_out_of_bounds": (safetensors_bytes({"a": _entry("F32", [4], 0, 16)}, bytes(8)), {"a": ("float32", [4])}),
    "overlapping_offsets": (
        safetensors_bytes({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 0, 8)}, bytes(8)),
        {"a": ("float32", [2]), "b": ("float32", [2])},
    ),
    "dtype_disagrees_with_byte_count": (
        safetensors_bytes({"a": _entry("F32", [3], 0, 8)}, bytes(8)),
        {"a": ("float32", [3])},
    ),
    "shape_of_2_40_elements": (
        safetensors_bytes({"a": _entry("F32", [2**40], 0, 8)}, bytes(8)),
        {"a": ("float32", [2**40])},
    ),
    "dtype_F128": (safetensors_bytes({"a": _entry("F128", [2], 0, 8)}, bytes(8)), {"a": ("float32", [2])}),
    "duplicate_header_keys": (
        safetensors_bytes(
            raw=b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
            b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
            data=bytes(8),
        ),
        {"a": ("float32", [2])},
    ),
}


@pytest.mark.parametrize("case", list(FORGED_SHARDS))
def test_a_forged_manifest_never_gets_verify_to_pass_what_load_refuses(tmp_path, case):
    url = str(tmp_path / "h")
    save_state_dict({"a": torch.zeros(2)}, url)
    data, tensors = FORGED_SHARDS[case]
    shard = replace_shard(url, data, tensors)
    for reader in (verify, load_state_dict):
        with pytest.raises(HandoffCorruptError) as info:
            reader(url)
        assert repr(shard) in str(info.value) and len(str(info.value)) < 600


@pytest.mark.parametrize("target", ["parent_path", "link_outside"])
def test_an_index_naming_a_file_outside_the_folder_fails_verify_and_opens_nothing_there(tmp_path, target):
    h, other, shard = two_handoffs(tmp_path)
    index = json.loads((h / INDEX).read_text())
    if target == "parent_path":
        index["weight_map"]["w"] = f"../other/{shard}"
        expected = "not a shard file name"
    else:  # a name of the format, for the shards of a save interrupted before its manifest
        (h / "model-00001-of-00002.safetensors").symlink_to(other / shard)
        index["weight_map"]["w"] = "model-00001-of-00002.safetensors"
        expected = "outside the folder"
    (h / INDEX).write_text(json.dumps(index))
    with opened_files() as opened, pytest.raises(HandoffCorruptError, match=expected):
        verify(str(h))
    assert not outside(opened, str(h))


@pytest.mark.slow
def test_a_shard_far_larger_than_its_manifest_says_is_refused_before_it_is_read(tmp_path):
    url = str(tmp_path / "h")
    manifest = save_state_dict({"w": torch.zeros(4)}, url)
    (shard,) = manifest["shards"]
    with open(tmp_path / "h" / shard, "r+b") as f:
        f.truncate(768 * 2**20)  # sparse: no disk used, 768 MiB to read
    result = run_python(
        "import resource, sys\n"
        "from stagesafe import load_state_dict, verify\n"
        "from stagesafe.errors import HandoffCorruptError\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "for reader in (load_state_dict, verify):\n"
        "    try:\n"
        f"        reader({url!r})\n"
        "    except HandoffCorruptError as exc:\n"
        "        print('refused', exc)\n"
        "print('grew_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count(f"is {768 * 2**20} bytes, the manifest says") == 2, result.stdout
    grew = int(result.stdout.split("grew_kib ")[1])
    assert grew < 64 * 1024, result.stdout  # nothing near 768 MiB was read into memory


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        (MANIFEST, b"[" * 200_000 + b"]" * 200_000, r"stagesafe\.json is not valid JSON \(nested too deeply\)"),
        (INDEX, b'{"metadata": {"total_size": 24}, "weight_map": ["w"]}', "is not a Hugging Face index"),
        (INDEX, b'{"weight_map": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nested too deeply"),
        (INDEX, b'{"metadata": {"total_size": 24}, "weight_map": {"w": ["a"]}}', r"in \['a'\], which is not a shard"),
    ],
)
def test_json_that_is_not_the_formats_is_a_corrupt_handoff(tmp_path, name, content, expected):
    url = str(tmp_path / "h")
    save_state_dict({"w": torch.zeros(6)}, url)
    (tmp_path / "h" / name).write_bytes(content)
    with pytest.raises(HandoffCorruptError, match=expected):
        verify(url)


def test_verify_during_a_commit_reads_the_new_handoff_instead_of_calling_the_index_stale(tmp_path):
    """A save writes its index just before its manifest: verify meeting the new index beside the old manifest
    waits a moment for that commit and then verifies the handoff it committed."""
    import os
    import shutil
    import threading

    folder, other = tmp_path / "h", tmp_path / "other"
    save_state_dict({"w": torch.zeros(4)}, str(folder))
    new = save_state_dict({"w": torch.ones(4)}, str(other))
    for shard in new["shards"]:  # the new save's shards and index are in place; its manifest is not, yet
        shutil.copy(other / shard, folder / shard)
    shutil.copy(other / INDEX, folder / INDEX)

    def commit() -> None:
        shutil.copy(other / MANIFEST, folder / "manifest.tmp")
        os.replace(folder / "manifest.tmp", folder / MANIFEST)

    committing = threading.Timer(0.3, commit)
    committing.start()
    try:
        assert verify(str(folder))["shards"] == new["shards"]
    finally:
        committing.join()
    assert_bitwise_equal(load_state_dict(str(folder)), {"w": torch.ones(4)})
