"""The commit: what the manifest records, a commit that replaces a handoff and the files it leaves to delete,
and shards that cannot be committed together."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest
import torch
from _handoffs import INDEX, MANIFEST, files, model_dict, read, url
from _tensors import assert_bitwise_equal

from stagesafe.errors import InvalidArgumentError
from stagesafe.publishing.commit import commit, commit_handoff, remove_replaced
from stagesafe.handoff.digest import DEFAULT, hash_buffer
from stagesafe.storage.fs import resolve
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.handoff.read import load_state_dict, read_manifest
from stagesafe.publishing.save import save_state_dict
from stagesafe.handoff.shards import write_shard
from stagesafe.publishing.verify import verify


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
