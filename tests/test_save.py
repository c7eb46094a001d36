"""save_state_dict and save_streamed on real files (plain paths and file:// URLs) and memory://: round trips of
every dtype, sharding, replacing a handoff, a save that fails midway, and the arguments a user gets wrong."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import safetensors.torch
import torch
from _handoffs import INDEX, MANIFEST, files, model_dict, read, url
from _tensors import assert_bitwise_equal

from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff.read import load_state_dict
from stagesafe.publishing.save import save_state_dict
from stagesafe.publishing.verify import verify


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


def test_second_save_replaces_the_first_and_leaves_no_stale_file(url):
    first = set(save_state_dict(model_dict(1, n=6), url, max_shard_size=800)["shards"])  # 3 shards
    sd2 = model_dict(2, n=2)
    second = set(save_state_dict(sd2, url, max_shard_size=800, overwrite=True)["shards"])  # 1 shard
    assert first.isdisjoint(second)  # every commit writes names of its own
    assert files(url) == second | {INDEX, MANIFEST}
    assert_bitwise_equal(load_state_dict(url), sd2)
    verify(url)


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


def test_metadata_that_is_not_json_is_refused_before_writing(url):
    with pytest.raises(InvalidArgumentError, match=r"metadata\['step'\].*\.item\(\)"):
        save_state_dict(model_dict(1), url, metadata={"step": torch.tensor(3)})
    assert files(url) == set()


def test_empty_state_dict_and_pathlike(tmp_path):
    manifest = save_state_dict({}, tmp_path / "h")
    assert manifest["shards"] == {} and load_state_dict(str(tmp_path / "h")) == {}
    assert json.loads((tmp_path / "h" / INDEX).read_text()) == {"metadata": {"total_size": 0}, "weight_map": {}}
    verify(str(tmp_path / "h"))


def test_workers_and_retry_arguments_are_checked(url):
    for bad in (0, -1, True, 2.0):
        with pytest.raises(InvalidArgumentError, match="workers="):
            save_state_dict(model_dict(1), url, workers=bad)
    with pytest.raises(InvalidArgumentError, match="must be a stagesafe.RetryPolicy"):
        load_state_dict(url, retry=3)
    assert files(url) == set()


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
