"""The handoff store on real files (plain paths and file:// URLs) and memory://: round trips, sharding, tied
weights, atomic replacement, clean-up, corruption, and the errors a user sees."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import signal
import os
import shutil
import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone

import fsspec
import pytest
import safetensors.torch
import torch
from _tensors import assert_bitwise_equal, bits
from _hostile import forge_manifest, opened_files, outside, replace_shard, run_python, safetensors_bytes

from stagesafe.handoff.digest import CHUNK, DEFAULT, LEAF, NAMES, hash_buffer
from stagesafe.handoff.fs import list_files, resolve
from stagesafe.handoff.manifest import digest_of, manifest_checksum
from stagesafe.errors import (
    HandoffCorruptError,
    HandoffExistsError,
    HandoffNotFoundError,
    InvalidArgumentError,
    StorageBackendError,
)
from stagesafe.handoff.store import (
    ORPHAN_AGE,
    Pieces,
    commit,
    commit_handoff,
    load_state_dict,
    plan_handoff,
    read_manifest,
    remove_replaced,
    remove_stale,
    save_state_dict,
    verify,
    write_shard,
)

INDEX, MANIFEST = "model.safetensors.index.json", "stagesafe.json"


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


def test_every_dtype_round_trips_bitwise(url):
    f32 = torch.tensor(
        [0x7FC00001, 0xFFC12345 - 2**32, 0x80000000 - 2**32, 0x7F800000, 1, 0x3F800000], dtype=torch.int32
    )
    f64 = torch.tensor([0x7FF8000000000123, -0x0007FFFFFFFFFFFF, 1], dtype=torch.int64)
    half_bits = torch.tensor([0x7E01, 0x7C00, -0x8000, 1, 0x3C00], dtype=torch.int16)
    sd = {
        "bool": torch.tensor([True, False, True]),
        "uint8": torch.arange(256, dtype=torch.uint8),
        "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "int16": torch.tensor([-(2**15), 2**15 - 1], dtype=torch.int16),
        "int32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
        "int64": torch.tensor([-(2**63), 2**63 - 1], dtype=torch.int64),
        "float16_nan_payloads": half_bits.view(torch.float16),
        "bfloat16_nan_payloads": half_bits.view(torch.bfloat16),
        "float32_nan_payloads": f32.view(torch.float32),  # quiet NaN with payload, -NaN, -0.0, inf, subnormal, 1.0
        "float64_nan_payloads": f64.view(torch.float64),
        "bfloat16": torch.randn(4, 5).to(torch.bfloat16),
        "float32": torch.randn(3, 4, 5),
        "float64": torch.randn(7, dtype=torch.float64),
        "zero_size": torch.empty(0, 3),
        "zero_size_int": torch.empty(0, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
    }
    manifest = save_state_dict(sd, url)
    assert_bitwise_equal(load_state_dict(url), sd)
    assert manifest["tensors"]["bfloat16"] == {"dtype": "bfloat16", "shape": [4, 5]}
    assert manifest["tensors"]["scalar"] == {"dtype": "float32", "shape": []}
    # Every shard carries {"format": "pt"}, which transformers' loaders check for.
    for name in manifest["shards"]:
        data = read(url, name)
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        assert header["__metadata__"] == {"format": "pt"}


def test_non_contiguous_and_trainable_tensors(url):
    base = torch.randn(4, 6)
    param = torch.nn.Parameter(torch.randn(3))
    sd = {"transposed": base.t(), "strided": base[:, ::2], "param": param}
    save_state_dict(sd, url)
    loaded = load_state_dict(url)
    for name, want in sd.items():
        assert torch.equal(loaded[name], want.detach()), name
        assert loaded[name].is_contiguous() and not loaded[name].requires_grad
    assert torch.equal(base, base)  # the caller's tensors are untouched


def test_small_max_shard_size_gives_hf_shards_each_loadable_by_safetensors(tmp_path):
    url = str(tmp_path / "h")
    sd = model_dict(0, n=10, numel=100)  # 400 bytes each
    manifest = save_state_dict(sd, url, max_shard_size="1KB")
    tag = next(iter(manifest["shards"])).split("-")[1]
    shards = [f"model-{tag}-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    assert files(url) == {*shards, INDEX, MANIFEST}
    assert list(manifest["shards"]) == shards
    seen = {}
    for name in shards:
        part = safetensors.torch.load_file(str(tmp_path / "h" / name))
        assert len(part) == 2
        seen.update(part)
    assert_bitwise_equal({k: seen[k] for k in sd}, sd)

    index_text = (tmp_path / "h" / INDEX).read_text()
    index = json.loads(index_text)
    assert list(index) == ["metadata", "weight_map"]
    assert index["metadata"] == {"total_size": 4000}
    assert index["weight_map"] == manifest["weight_map"]
    assert index["weight_map"]["layer0.weight"] == shards[0] and index["weight_map"]["layer9.weight"] == shards[4]
    assert index_text == json.dumps(index, indent=2, sort_keys=True) + "\n"  # as transformers writes it


def test_a_tensor_over_the_limit_gets_its_own_shard(url):
    sd = {"small": torch.zeros(10), "big": torch.zeros(1000), "small2": torch.zeros(10)}
    manifest = save_state_dict(sd, url, max_shard_size=100)
    assert [len(v) for v in _by_shard(manifest).values()] == [1, 1, 1]
    assert_bitwise_equal(load_state_dict(url), sd)


def _by_shard(manifest):
    out = {}
    for name, file in manifest["weight_map"].items():
        out.setdefault(file, []).append(name)
    return out


def test_manifest_records_hashes_tensors_metadata_versions(url):
    sd = model_dict(1)
    meta = {"stage": "fit", "global_step": 12, "epoch": 3, "world_size": 2}
    manifest = save_state_dict(sd, url, metadata=meta, max_shard_size=900)
    assert json.loads(read(url, MANIFEST)) == manifest == read_manifest(url)
    assert manifest["format"] == "stagesafe/2" and manifest["digest"] == DEFAULT
    assert manifest["metadata"] == meta
    assert manifest["total_size"] == 2400
    assert manifest["tensors"]["layer0.weight"] == {"dtype": "float32", "shape": [100]}
    for name, rec in manifest["shards"].items():
        data = read(url, name)
        assert rec == {DEFAULT: hash_buffer(DEFAULT, data), "size": len(data)}
    assert {"python", "torch", "safetensors", "fsspec", "stagesafe"} <= set(manifest["versions"])
    assert manifest["versions"]["torch"] == torch.__version__
    created = datetime.fromisoformat(manifest["created"])
    assert created.utcoffset() == timedelta(0)


def test_tied_weights_are_stored_once_and_come_back_as_one_object(url):
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11, bias=False))
    model[1].weight = model[0].weight  # tied, as lm_head and the embedding of a language model
    sd = model.state_dict()  # .detach() gives distinct objects over the same memory
    assert sd["1.weight"] is not sd["0.weight"]
    manifest = save_state_dict(sd, url)
    assert manifest["aliases"] == {"1.weight": "0.weight"}
    assert list(manifest["weight_map"]) == ["0.weight"]
    assert manifest["total_size"] == 11 * 4 * 4
    loaded = load_state_dict(url)
    assert list(loaded) == ["0.weight", "1.weight"]
    assert loaded["1.weight"] is loaded["0.weight"]
    assert torch.equal(loaded["0.weight"], model[0].weight.detach())


def test_views_same_exactly_are_aliases_overlapping_ones_copies(url):
    base = torch.arange(12, dtype=torch.float32)
    sd = {
        "base": base,
        "head": base[0:6],  # overlaps base and mid: written as its own copy
        "mid": base[4:10],
        "head_again": base[0:6],  # the very same view as head: an alias
        "evens": base[::2],  # non-contiguous view
        "as_int": base.view(torch.int32),  # same bytes, another dtype: not an alias
    }
    manifest = save_state_dict(sd, url)
    assert manifest["aliases"] == {"head_again": "head"}
    loaded = load_state_dict(url)
    for name, want in sd.items():
        assert torch.equal(loaded[name], want), name
    assert loaded["head_again"] is loaded["head"]
    loaded["head"][0] = 100.0  # independent storage after loading
    assert loaded["base"][0] == 0.0 and loaded["mid"][0] == 4.0


def test_second_save_replaces_the_first_and_leaves_no_stale_file(url):
    first = set(save_state_dict(model_dict(1, n=6), url, max_shard_size=800)["shards"])  # 3 shards
    sd2 = model_dict(2, n=2)
    second = set(save_state_dict(sd2, url, max_shard_size=800, overwrite=True)["shards"])  # 1 shard
    assert first.isdisjoint(second)  # every commit writes names of its own
    assert files(url) == second | {INDEX, MANIFEST}
    assert_bitwise_equal(load_state_dict(url), sd2)
    verify(url)


def test_the_replaced_handoff_can_be_removed_after_the_commit(url):
    first = set(save_state_dict(model_dict(1, n=6), url, max_shard_size=800)["shards"])  # 3 shards
    sd2 = model_dict(2, n=4)
    fs, root = resolve(url)
    plan = plan_handoff(sd2, max_shard_size=800)
    records = {name: write_shard(fs, root, name, plan.shard_tensors(name)) for name in plan.shards}
    done = commit_handoff(fs, root, plan, records)
    second = set(done.manifest["shards"])
    assert done.replaced == first
    assert files(url) == first | second | {INDEX, MANIFEST}  # committed; the old shards are still there
    assert_bitwise_equal(load_state_dict(url), sd2)
    remove_replaced(fs, root, done)  # all three at once
    assert files(url) == second | {INDEX, MANIFEST}
    verify(url)


def test_removing_stale_files_never_raises(caplog):
    with caplog.at_level("WARNING", logger="stagesafe.handoff.store"):
        remove_stale("nosuchprotocol://bucket/weights")  # the store cannot even be opened
    assert "could not delete stale files under nosuchprotocol://bucket/weights" in caplog.text


def test_shards_written_but_not_committed_do_not_change_the_committed_handoff(url):
    sd1 = model_dict(1, n=4)
    save_state_dict(sd1, url, max_shard_size=800)
    old_files = files(url)

    # The steps a rank runs, stopped before commit: as if the writer were killed there.
    fs, root = resolve(url)
    sd2 = model_dict(2, n=4)
    plan = plan_handoff(sd2, max_shard_size=800)
    assert set(plan.shards).isdisjoint(old_files)
    records = {name: write_shard(fs, root, name, plan.shard_tensors(name)) for name in plan.shards}
    assert files(url) == old_files | set(plan.shards)
    assert_bitwise_equal(load_state_dict(url), sd1)
    verify(url)

    first, *rest = plan.shards
    with pytest.raises(InvalidArgumentError, match=f"planned shards not written \\['{first}'\\]"):
        commit(fs, root, plan, {name: records[name] for name in rest})
    assert_bitwise_equal(load_state_dict(url), sd1)
    manifest = commit(fs, root, plan, records, metadata={"stage": "fit"})
    assert manifest == read_manifest(url)
    assert files(url) == set(plan.shards) | {INDEX, MANIFEST}
    assert_bitwise_equal(load_state_dict(url), sd2)


def test_pieces_are_written_as_the_tensor_they_join_into(tmp_path):
    """A value given as pieces (views of mapped files, in the CLI) is stored as the one tensor they join into,
    each piece handed back once written."""
    full = torch.randn(6, 5)
    flat = full.view(-1)
    parts = (flat[:7], flat[7:20], flat[20:])
    used: list[torch.Tensor] = []
    bias = torch.randn(5)
    values = {"w": Pieces(torch.float32, (6, 5), parts, done=used.append), "b": bias}
    specs = {"w": {"dtype": "float32", "shape": [6, 5]}, "b": {"dtype": "float32", "shape": [5]}}
    fs, root = resolve(str(tmp_path))
    plan = plan_handoff({"w": full, "b": bias})
    (name,) = plan.shards
    record = write_shard(fs, root, name, values, specs=specs)
    loaded = safetensors.torch.load_file(str(tmp_path / name))
    assert_bitwise_equal(loaded, {"w": full, "b": bias})
    assert [id(p) for p in used] == [id(p) for p in parts]
    assert record.digest == DEFAULT
    assert record.hexdigest == hash_buffer(DEFAULT, (tmp_path / name).read_bytes())

    wrong = {"w": Pieces(torch.float32, (5, 6), parts), "b": bias}
    with pytest.raises(InvalidArgumentError, match=r"'w' is float32\[5, 6\] but was planned as float32\[6, 5\]"):
        write_shard(fs, root, name, wrong, specs=specs)


def test_a_reader_overtaken_by_a_new_commit_reads_the_new_handoff(url, monkeypatch):
    import stagesafe.handoff.store as store

    save_state_dict(model_dict(1, n=4), url, max_shard_size=800)
    stale = read_manifest(url)
    sd2 = model_dict(2, n=4)
    save_state_dict(sd2, url, max_shard_size=800, overwrite=True)  # deletes the shards the stale manifest names
    real, calls = store._read_manifest, []

    def first_stale(fs, root):  # the reader read the manifest just before the writer committed
        calls.append(root)
        return stale if len(calls) == 1 else real(fs, root)

    monkeypatch.setattr(store, "_read_manifest", first_stale)
    assert_bitwise_equal(load_state_dict(url), sd2)
    assert len(calls) == 2


class _FailsOn(dict):
    """A state dict whose tensor ``bad`` cannot be read when its shard is written (a dying device, say)."""

    def __init__(self, items, bad):
        super().__init__(items)
        self.bad = bad

    def __getitem__(self, key):
        if key == self.bad:
            raise RuntimeError("device lost while reading " + key)
        return super().__getitem__(key)


def test_a_save_failing_midway_keeps_the_old_handoff_and_removes_its_own_shards(url):
    sd1 = model_dict(1, n=4)
    save_state_dict(sd1, url, max_shard_size=800)
    old_files = files(url)
    with pytest.raises(RuntimeError, match="device lost"):
        save_state_dict(_FailsOn(model_dict(2, n=4), bad="layer3.weight"), url, max_shard_size=800, overwrite=True)
    assert files(url) == old_files
    assert_bitwise_equal(load_state_dict(url), sd1)


def test_leftovers_of_killed_writers_are_cleaned_once_old_and_young_ones_are_left_to_their_writer(url):
    save_state_dict(model_dict(1), url)
    leftovers = [
        "model-1234abcd-00001-of-00001.safetensors.tmp-deadbeef",
        "stagesafe.json.tmp-0123abcd",
        "model.safetensors.index.json.tmp-00ff00ff",
        "model-0badcafe-00001-of-00003.safetensors",  # renamed into place, never committed
    ]
    for name in [*leftovers, "notes.txt", "notes.txt.tmp-deadbeef"]:
        write(url, name, b"junk")
    save_state_dict(model_dict(2), url, overwrite=True)
    # young: perhaps another writer's commit in progress, which must not lose its files
    assert set(leftovers) <= files(url)
    for name in leftovers:
        age(url, name, ORPHAN_AGE + 60)
    save_state_dict(model_dict(3), url, overwrite=True)
    assert files(url) == set(read_manifest(url)["shards"]) | {INDEX, MANIFEST, "notes.txt", "notes.txt.tmp-deadbeef"}
    assert_bitwise_equal(load_state_dict(url), model_dict(3))
    write(url, "model-00000001-00001-of-00001.safetensors", b"junk")
    age(url, "model-00000001-00001-of-00001.safetensors", ORPHAN_AGE + 60)
    remove_stale(url)  # the same, on demand
    assert "model-00000001-00001-of-00001.safetensors" not in files(url)


def _three_shards(url):
    sd = model_dict(5, n=6)
    manifest = save_state_dict(sd, url, max_shard_size=800, overwrite=True)
    return sd, list(manifest["shards"])


def _flip_byte(url, shard):
    data = bytearray(read(url, shard))
    data[len(data) - 7] ^= 0xFF  # inside the tensor data: safetensors alone would not notice
    write(url, shard, bytes(data))
    return f"has {DEFAULT}"


def _truncate(url, shard):
    write(url, shard, read(url, shard)[:-10])
    return "bytes, the manifest says"


def _remove(url, shard):
    fs, root = resolve(url)
    fs.rm_file(f"{root}/{shard}")
    return "missing"


@pytest.mark.parametrize("damage", [_flip_byte, _truncate, _remove])
def test_damaged_shards_are_refused_by_verify_and_load(url, damage):
    _, shards = _three_shards(url)
    expected = damage(url, shards[1])
    for reader in (verify, load_state_dict):
        with pytest.raises(HandoffCorruptError, match=expected) as info:
            reader(url)
        assert repr(shards[1]) in str(info.value)


def test_weight_map_disagreeing_with_a_shard_is_refused_by_verify_and_load(url):
    _, shards = _three_shards(url)
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
    sd, shards = _three_shards(url)
    index = json.loads(read(url, INDEX))
    index["weight_map"]["layer0.weight"] = shards[2]
    write(url, INDEX, json.dumps(index).encode())
    with pytest.raises(HandoffCorruptError, match=f"in another shard, e.g. 'layer0.weight' in '{shards[2]}'"):
        verify(url)
    assert_bitwise_equal(load_state_dict(url), sd)  # the manifest, not the index, defines the handoff


def test_a_damaged_manifest_is_refused(url):
    _three_shards(url)
    write(url, MANIFEST, b'{"format": "stagesafe/1", "shards": ')
    for reader in (verify, load_state_dict, read_manifest):
        with pytest.raises(HandoffCorruptError, match=r"stagesafe\.json is not valid JSON"):
            reader(url)


def test_overwrite_false_refuses_an_existing_handoff(url):
    sd = model_dict(1)
    save_state_dict(sd, url, overwrite=False)  # nothing there yet: fine
    with pytest.raises(HandoffExistsError, match="pass overwrite=True") as info:
        save_state_dict(model_dict(2), url, overwrite=False)
    assert isinstance(info.value, FileExistsError)
    assert_bitwise_equal(load_state_dict(url), sd)


def test_the_default_refuses_a_handoff_or_its_files_and_leaves_other_files_alone(url):
    write(url, "config.json", b"{}")
    save_state_dict(model_dict(1), url)  # the default is overwrite=False: a config.json is no handoff
    assert read(url, "config.json") == b"{}"
    with pytest.raises(HandoffExistsError, match="already holds a handoff"):
        save_state_dict(model_dict(2), url)
    stray = f"{url}/stray"
    write(stray, "model-00001-of-00002.safetensors", b"junk")  # a handoff's shard without its manifest
    with pytest.raises(HandoffExistsError, match="model files"):
        save_state_dict(model_dict(2), stray)
    assert_bitwise_equal(load_state_dict(url), model_dict(1))


def test_missing_handoff_says_where_and_asks_about_the_folder(url):
    with pytest.raises(HandoffNotFoundError, match="Is this the right folder") as info:
        load_state_dict(url)
    assert isinstance(info.value, FileNotFoundError)
    assert url.split("://")[-1] in str(info.value)


def test_missing_handoff_hints(tmp_path):
    url = str(tmp_path / "h")
    save_state_dict(model_dict(1), url)
    (tmp_path / "h" / "sub").mkdir()
    with pytest.raises(HandoffNotFoundError, match=r"sub-folder.*pass its parent"):
        read_manifest(f"{url}/sub")
    with pytest.raises(HandoffNotFoundError, match="that is a file"):
        read_manifest(f"{url}/{INDEX}")
    with pytest.raises(HandoffNotFoundError, match=r"sub-folders \['h'\] hold handoffs: pass one of them"):
        read_manifest(str(tmp_path))
    (tmp_path / "h" / MANIFEST).unlink()
    with pytest.raises(HandoffNotFoundError, match=r"no stagesafe\.json, so a write was interrupted"):
        load_state_dict(url)


def test_unknown_protocol_and_missing_backend():
    with pytest.raises(StorageBackendError, match="'nosuchproto'") as info:
        load_state_dict("nosuchproto://bucket/run")
    assert isinstance(info.value, ImportError)
    for url, extra, package in (
        ("s3://b/run", "s3", "s3fs"),
        ("gs://b/run", "gcs", "gcsfs"),
        ("az://c/run", "azure", "adlfs"),
    ):
        if importlib.util.find_spec(package) is not None:
            continue
        with pytest.raises(StorageBackendError, match=rf"install 'stagesafe\[{extra}\]'"):
            save_state_dict({}, url)


def test_metadata_that_is_not_json_is_refused_before_writing(url):
    with pytest.raises(InvalidArgumentError, match=r"metadata\['step'\].*\.item\(\)"):
        save_state_dict(model_dict(1), url, metadata={"step": torch.tensor(3)})
    assert files(url) == set()


@pytest.mark.parametrize(
    ("sd", "pattern"),
    [
        ({"w": [1.0, 2.0]}, r"state_dict\['w'\] is a list, not a torch.Tensor"),
        ({"w": torch.empty(3, device="meta")}, "meta device"),
        ({"w": torch.zeros(2, dtype=torch.complex128)}, "complex128"),
        ({"w": torch.zeros(3, 3).to_sparse()}, "to_dense"),
        ({3: torch.zeros(1)}, "key 3 must be a non-empty str"),
    ],
)
def test_state_dict_entries_that_cannot_be_stored(url, sd, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        save_state_dict(sd, url)
    assert files(url) == set()


def test_empty_state_dict_and_pathlike(tmp_path):
    manifest = save_state_dict({}, tmp_path / "h")
    assert manifest["shards"] == {} and load_state_dict(str(tmp_path / "h")) == {}
    assert json.loads((tmp_path / "h" / INDEX).read_text()) == {"metadata": {"total_size": 0}, "weight_map": {}}
    verify(str(tmp_path / "h"))


@pytest.mark.parametrize("workers", [1, 3])
def test_parallel_transfers_round_trip_and_name_the_first_damaged_shard(url, workers):
    sd = model_dict(7, n=8)
    manifest = save_state_dict(sd, url, max_shard_size=400, workers=workers)
    shards = list(manifest["shards"])
    assert len(shards) == 8
    assert_bitwise_equal(load_state_dict(url, workers=workers), sd)
    assert verify(url, workers=workers) == manifest
    for name in (shards[6], shards[2]):
        _flip_byte(url, name)
    for reader in (verify, load_state_dict):  # the same shard as a loop over the shards would name
        with pytest.raises(HandoffCorruptError, match=f"shard '{shards[2]}' has {DEFAULT}"):
            reader(url, workers=workers)


def test_workers_and_retry_arguments_are_checked(url):
    for bad in (0, -1, True, 2.0):
        with pytest.raises(InvalidArgumentError, match="workers="):
            save_state_dict(model_dict(1), url, workers=bad)
    with pytest.raises(InvalidArgumentError, match="must be a stagesafe.handoff.store.RetryPolicy"):
        load_state_dict(url, retry=3)
    assert files(url) == set()


def test_a_shard_this_process_wrote_is_mapped_but_a_changed_one_is_hashed_again(tmp_path):
    from stagesafe.handoff import local_shards as _local_shards

    url = str(tmp_path / "handoff")
    sd, shards = _three_shards(url)
    path = str(tmp_path / "handoff" / shards[1])
    digest = read_manifest(url)["shards"][shards[1]][DEFAULT]
    assert _local_shards.known(path, DEFAULT, digest)  # the writer hashed these very bytes: no second pass needed
    assert not _local_shards.known(path, "sha256", digest)  # the same hex under another digest's name is not
    assert_bitwise_equal(load_state_dict(url), sd)
    _flip_byte(url, shards[1])  # a new file (same name): no longer the one that was hashed
    assert not _local_shards.known(path, DEFAULT, digest)
    with pytest.raises(HandoffCorruptError, match=DEFAULT):
        load_state_dict(url)


def test_verify_false_checks_sizes_and_headers_but_not_hashes(tmp_path):
    url = str(tmp_path / "handoff")
    sd, shards = _three_shards(url)
    _flip_byte(url, shards[1])
    loaded = load_state_dict(url, verify=False)  # what load_file would give: the changed byte included
    changed = [name for name in sd if not torch.equal(bits(loaded[name]), bits(sd[name]))]
    assert len(changed) == 1
    _truncate(url, shards[2])
    with pytest.raises(HandoffCorruptError, match="bytes, the manifest says"):
        load_state_dict(url, verify=False)
    with pytest.raises(InvalidArgumentError, match="verify="):
        load_state_dict(url, verify="yes")


@pytest.fixture(params=["path", "memory"])
def big_url(request, tmp_path):
    """A local and a remote handoff location, for shards of tens of MB."""
    if request.param == "path":
        yield str(tmp_path / "handoff")
    else:
        root = f"/stagesafe-tests/{uuid.uuid4().hex}"
        yield f"memory://{root}"
        fsspec.filesystem("memory").rm(root, recursive=True)


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


def test_an_old_sha256_handoff_loads_and_verifies(tmp_path, capsys):
    """tests/data/handoff-sha256 was written by stagesafe before the digest was named (commit d9135f2)."""
    from stagesafe.cli import main
    from stagesafe.handoff.store import HandoffReader

    url = str(tmp_path / "old")
    shutil.copytree(os.path.join(os.path.dirname(__file__), "data", "handoff-sha256"), url)
    embed = torch.arange(64, dtype=torch.float32).reshape(16, 4) / 8
    expected = {
        "embed.weight": embed,
        "layer.weight": (torch.arange(32, dtype=torch.float32) - 16).reshape(4, 8).to(torch.bfloat16),
        "layer.steps": torch.tensor([3, 1, 4]),
        "head.weight": embed,
    }
    manifest = read_manifest(url)
    assert manifest["format"] == "stagesafe/1" and digest_of(manifest) == "sha256"
    assert verify(url) == manifest
    loaded = load_state_dict(url)
    assert_bitwise_equal(loaded, expected)
    assert loaded["head.weight"] is loaded["embed.weight"]
    assert_bitwise_equal(dict(HandoffReader(url)), expected)
    assert main(["verify", url]) == 0
    assert "(digest sha256)" in capsys.readouterr().out
    shard = sorted(manifest["shards"])[0]
    _flip_byte(url, shard)
    for reader in (verify, load_state_dict):
        with pytest.raises(HandoffCorruptError, match=f"shard '{shard}' has sha256 "):
            reader(url)


def test_a_sha256_handoff_written_now_has_the_layout_older_readers_read(tmp_path):
    url = str(tmp_path / "h")
    sd = model_dict(3)
    manifest = save_state_dict(sd, url, digest="sha256")
    with open(os.path.join(os.path.dirname(__file__), "data", "handoff-sha256", MANIFEST)) as f:
        old = json.load(f)
    assert manifest["format"] == old["format"] == "stagesafe/1" and list(manifest) == list(old)
    for name, rec in manifest["shards"].items():
        assert rec == {"sha256": hashlib.sha256(read(url, name)).hexdigest(), "size": len(read(url, name))}
    assert_bitwise_equal(load_state_dict(url), sd)


def test_an_unknown_digest_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(InvalidArgumentError, match="digest='md5' is not one stagesafe knows; pass one of"):
        save_state_dict(model_dict(1), str(tmp_path / "h"), digest="md5")
    assert not (tmp_path / "h").exists()


def test_a_handoff_naming_a_digest_this_stagesafe_does_not_know_asks_for_an_upgrade(tmp_path):
    url = str(tmp_path / "h")
    save_state_dict(model_dict(1), url)
    forge_manifest(url, lambda m: m.update(digest="xxh4-512"))
    for reader in (verify, load_state_dict, read_manifest):
        with pytest.raises(HandoffCorruptError, match="digest 'xxh4-512' is not one this stagesafe knows.*upgrade"):
            reader(url)


def test_shards_hashed_with_different_digests_are_not_committed(tmp_path):
    fs, root = resolve(str(tmp_path))
    sd = model_dict(2, n=4)
    plan = plan_handoff(sd, max_shard_size=800)
    first, second = plan.shards
    records = {
        first: write_shard(fs, root, first, plan.shard_tensors(first)),
        second: write_shard(fs, root, second, plan.shard_tensors(second), digest="sha256"),
    }
    with pytest.raises(InvalidArgumentError, match=r"hashed with different digests \['sha256', 'xxh3-128-tree'\]"):
        commit(fs, root, plan, records)
    assert MANIFEST not in files(str(tmp_path))


def test_verify_false_reads_a_remote_shard_without_hashing_it():
    url = f"memory:///stagesafe-tests/{uuid.uuid4().hex}"
    sd, shards = _three_shards(url)
    _flip_byte(url, shards[1])
    loaded = load_state_dict(url, verify=False)
    assert sum(not torch.equal(bits(loaded[name]), bits(sd[name])) for name in sd) == 1
    with pytest.raises(HandoffCorruptError, match=f"has {DEFAULT}"):
        load_state_dict(url)


def test_a_loaded_shard_holds_views_of_one_buffer_that_safetensors_can_save(tmp_path):
    url = str(tmp_path / "handoff")
    sd = {"a": torch.arange(10, dtype=torch.float16), "b": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    save_state_dict(sd, url)
    loaded = load_state_dict(url)
    assert loaded["a"].untyped_storage().data_ptr() == loaded["b"].untyped_storage().data_ptr()
    assert_bitwise_equal(loaded, sd)
    safetensors.torch.save_file(loaded, str(tmp_path / "again.safetensors"))  # views that do not overlap
    again = safetensors.torch.load_file(str(tmp_path / "again.safetensors"))
    assert_bitwise_equal({name: again[name] for name in sd}, sd)


def test_check_writable_fails_early_and_leaves_nothing(tmp_path):
    from stagesafe.errors import StorageTransferError
    from stagesafe.handoff.store import check_writable

    url = str(tmp_path / "handoff")
    check_writable(url)
    assert files(url) == set()  # the probe file is gone
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(StorageTransferError, match="a_file"):
        check_writable(str(blocker / "handoff"))


# -- hostile handoffs: files crafted by someone who knows the format ---------------------------------------------

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


def _two_handoffs(tmp_path):
    """Handoffs ``h`` and ``other`` side by side, of the same state dict: byte for byte the same shards."""
    sd = {"w": torch.arange(6.0)}
    (shard,) = save_state_dict(sd, str(tmp_path / "h"))["shards"]
    (theirs,) = save_state_dict(sd, str(tmp_path / "other"))["shards"]
    os.rename(tmp_path / "other" / theirs, tmp_path / "other" / shard)  # the same name in both folders
    return tmp_path / "h", tmp_path / "other", shard


def test_a_shard_that_links_outside_the_folder_is_refused_unopened(tmp_path):
    h, other, shard = _two_handoffs(tmp_path)
    (h / shard).unlink()
    (h / shard).symlink_to(other / shard)  # the very bytes the manifest hashes
    for reader in (verify, load_state_dict, lambda u: load_state_dict(u, verify=False)):
        refused = pytest.raises(HandoffCorruptError, match="symbolic link to .*outside the folder")
        with opened_files() as opened, refused:
            reader(str(h))
        assert not outside(opened, str(h))
    (h / shard).unlink()
    (h / shard).symlink_to(shard + ".copy")  # a link inside the folder is fine
    os.link(other / shard, h / (shard + ".copy"))
    assert torch.equal(load_state_dict(str(h))["w"], torch.arange(6.0))


@pytest.mark.parametrize("target", ["parent_path", "link_outside"])
def test_an_index_naming_a_file_outside_the_folder_fails_verify_and_opens_nothing_there(tmp_path, target):
    h, other, shard = _two_handoffs(tmp_path)
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


def test_a_manifest_too_large_to_be_one_is_refused_unread(tmp_path):
    url = str(tmp_path / "h")
    save_state_dict({"w": torch.zeros(6)}, url)
    with open(tmp_path / "h" / MANIFEST, "r+b") as f:
        f.truncate(2**40)  # sparse
    for reader in (read_manifest, load_state_dict, verify):
        with pytest.raises(HandoffCorruptError, match=r"stagesafe\.json is 1099511627776 bytes, more than"):
            reader(url)


_READERS = """
import json, sys, torch
from torch import nn
from stagesafe import load_state_dict, read_manifest, restore, verify
from stagesafe.cli import main
from stagesafe.handoff.store import HandoffReader

url = sys.argv[1] if len(sys.argv) > 1 else {url!r}
readers = {{
    "load_state_dict": lambda: load_state_dict(url),
    "load_state_dict(verify=False)": lambda: load_state_dict(url, verify=False),
    "verify": lambda: verify(url),
    "restore": lambda: restore(nn.Linear(3, 2), url),
    "HandoffReader": lambda: dict(HandoffReader(url)),
    "cli verify": lambda: main(["verify", url]),
    "cli inspect": lambda: main(["inspect", url]),
}}
out = {{}}
for name, read in readers.items():
    try:
        out[name] = ["returned", repr(read())[:60]]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]
print("RESULT " + json.dumps(out))
"""


def _read_in_a_process(url: str) -> dict:
    result = run_python(_READERS.format(url=url), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.parametrize("what", ["shard", "link_to_a_fifo", "manifest", "index", "index_entry"])
def test_a_fifo_in_a_handoff_is_refused_by_every_reader_without_blocking(tmp_path, what):
    """Opening a FIFO for reading blocks until a writer comes. Each reader runs in a process of its own with a
    timeout, so that a reader that blocks fails this test instead of hanging it."""
    url = str(tmp_path / "h")
    (shard,) = save_state_dict(nn_linear_state(), url)["shards"]
    h = tmp_path / "h"
    if what in ("shard", "manifest", "index"):
        name = {"shard": shard, "manifest": MANIFEST, "index": INDEX}[what]
        (h / name).unlink()
        os.mkfifo(h / name)
    elif what == "link_to_a_fifo":
        (h / shard).unlink()
        os.mkfifo(h / "pipe")
        (h / shard).symlink_to(h / "pipe")
    else:
        os.mkfifo(h / "model-00001-of-00002.safetensors")
        index = json.loads((h / INDEX).read_text())
        index["weight_map"] = {"weight": "model-00001-of-00002.safetensors", "bias": "model-00001-of-00002.safetensors"}
        (h / INDEX).write_text(json.dumps(index))
    outcomes = _read_in_a_process(url)
    readers_of = {  # which readers open the file: inspect reads the manifest only, loads never read the index
        "manifest": set(outcomes),
        "shard": set(outcomes) - {"cli inspect"},
        "link_to_a_fifo": set(outcomes) - {"cli inspect"},
        "index": {"verify", "cli verify"},
        "index_entry": {"verify", "cli verify"},
    }[what]
    for reader, (kind, message) in outcomes.items():
        if reader not in readers_of:
            assert (kind, message[:1]) in (("returned", "{"), ("returned", "0"), ("returned", "L")), (reader, message)
        elif reader.startswith("cli"):
            assert (kind, message) == ("returned", "1"), (reader, message)  # exit 1: the handoff failed its checks
        else:
            assert kind == "HandoffCorruptError", (reader, kind, message)
            assert "FIFO" in message, (reader, message)


def nn_linear_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(2, 3, generator=g), "bias": torch.randn(2, generator=g)}


def test_a_load_shows_a_bar_on_a_terminal_when_asked_and_stays_quiet_otherwise(tmp_path, capsys):
    uri = str(tmp_path / "h")
    save_state_dict({"a": torch.zeros(1000), "b": torch.ones(1000)}, uri, max_shard_size=5000)
    load_state_dict(uri)  # a non-interactive run (pytest's stderr) and a small handoff: nothing
    assert capsys.readouterr().err == ""
    load_state_dict(uri, progress=True)
    err = capsys.readouterr().err
    size = sum(r["size"] for r in read_manifest(uri)["shards"].values())
    assert f"loading {uri}" in err and f"{size / 1000:.2f}k" in err  # the handoff's bytes, in decimal units


_TRUNCATE_UNDER = """
import os, sys, torch, glob
from safetensors.torch import load_file
import stagesafe
uri, who, when = sys.argv[1], sys.argv[2], sys.argv[3]
shard = sorted(glob.glob(os.path.join(uri, "*.safetensors")))[0]
if when == "before":
    os.truncate(shard, os.path.getsize(shard) // 2)
loaded = load_file(shard) if who == "load_file" else stagesafe.load_state_dict(uri)
if when == "after":  # a tool truncates the file in place while the tensors are in use
    os.truncate(shard, 4096)
print("SUM", float(sum(t.float().sum() for t in loaded.values())), flush=True)
"""


@pytest.mark.parametrize("who", ["stagesafe", "load_file"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_shard_truncated_under_the_mapping_is_refused_before_and_fails_as_load_file_after(tmp_path, who, when):
    """The fast path maps local shards, as load_file does. Sizes are checked before a byte is read, so a file cut
    before the load is refused; one cut in place while its tensors are in use faults on the missing pages
    (SIGBUS), as with load_file: stagesafe's own writers never truncate in place (docs/reliability.md, Limits)."""
    uri = str(tmp_path / "h")
    save_state_dict({"w": torch.ones(1 << 20)}, uri)  # 4 MB, one shard
    result = run_python(_TRUNCATE_UNDER, uri, who, when)
    if when == "after":
        assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr[-500:])
    elif who == "stagesafe":
        assert result.returncode == 1 and "HandoffCorruptError" in result.stderr, result.stderr[-500:]
        assert "SUM" not in result.stdout
    else:
        assert result.returncode != 0  # load_file refuses a cut file too ("incomplete metadata" or similar)
