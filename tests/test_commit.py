"""publishing/commit.py: the one commit protocol, plan -> shards -> commit. What the manifest records, a commit
that replaces a handoff and the files it leaves to delete, and shards that cannot be committed together; the
protocol on one process, and for a write by several ranks through a record exchange (here a plain one in this
process, posting and gathering in a dict: the strategy's, over the job's key-value store, is
tests/test_shared_write.py's)."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime, timedelta

import pytest
import torch
from _handoffs import INDEX, MANIFEST, files, model_dict, read, url
from _tensors import assert_bitwise_equal

from stagesafe.errors import InvalidArgumentError, StorageTransferError
from stagesafe.publishing.commit import commit, commit_handoff, remove_replaced, write_and_commit
from stagesafe.handoff.digest import DEFAULT, hash_buffer
from stagesafe.storage.fs import resolve
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.handoff.read import load_state_dict, read_manifest
from stagesafe.publishing.save import save_state_dict
from stagesafe.handoff.names import INDEX_NAME, MANIFEST_NAME
from stagesafe.handoff.shards import ShardRecord, write_shard
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
    remove_replaced(done)  # all three at once
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


# -- the protocol: plan -> shards -> commit -------------------------------------------------------------------
def _values(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(30 + i, generator=g) for i in range(4)}


def test_one_process_writes_every_shard_then_commits(tmp_path):
    values = _values()
    fs, root = resolve(str(tmp_path / "h"))
    plan = plan_handoff(values, max_shard_size=200)
    done = write_and_commit(fs, root, plan, metadata={"step": 1})
    assert set(done.manifest["shards"]) == set(plan.shards) and len(plan.shards) > 1
    assert done.manifest["metadata"] == {"step": 1} and done.replaced == frozenset()
    assert_bitwise_equal(load_state_dict(str(tmp_path / "h")), values)


def test_it_deletes_nothing_the_commit_replaced_and_says_what_that_is(tmp_path):
    uri = str(tmp_path / "h")
    old = set(save_state_dict(_values(1), uri, max_shard_size=200)["shards"])
    fs, root = resolve(uri)
    done = write_and_commit(fs, root, plan_handoff(_values(2), max_shard_size=200, taken=old), metadata=None)
    assert done.replaced == old and old <= files(uri)  # the caller removes them (remove_replaced)
    assert_bitwise_equal(load_state_dict(uri), _values(2))


@pytest.mark.parametrize("empty_before", [True, False])
def test_a_commit_that_fails_leaves_nothing_only_in_a_folder_that_held_no_handoff(tmp_path, empty_before):
    dst = tmp_path / "h"
    (dst / MANIFEST_NAME).mkdir(parents=True)  # the manifest cannot be put in place: the commit fails
    fs, root = resolve(str(dst))
    plan = plan_handoff(_values(), max_shard_size=200)
    with pytest.raises(Exception, match=MANIFEST_NAME):
        write_and_commit(fs, root, plan, metadata=None, empty_before=empty_before)
    left = set(os.listdir(dst)) - {MANIFEST_NAME}
    assert left == (set() if empty_before else set(plan.shards))  # else the next save cleans them up when old


class _Exchange:
    """Two ranks' records through a dict, as a job's key-value store would carry them."""

    def __init__(self, board: dict, rank: int, writers: int = 2) -> None:
        self.board, self.rank, self.writers = board, rank, writers

    def post(self, records, error):
        self.board[self.rank] = (dict(records), None if error is None else str(error))

    def gather(self, url):
        records, failed = {}, {}
        for rank in range(1, self.writers):
            if rank not in self.board:
                return {}, TimeoutError(f"rank {rank} did not answer about {url}"), {}
            posted, error = self.board[rank]
            records.update(posted)
            if error is not None:
                failed[rank] = error
        return records, None, failed


def _halves(plan):
    files_ = list(plan.shards)
    return files_[::2], files_[1::2]


def test_rank_0_commits_every_ranks_shards_once_each_has_posted_its_records(tmp_path):
    values = _values()
    fs, root = resolve(str(tmp_path / "h"))
    plan = plan_handoff(values, max_shard_size=200, tag="0badcafe")
    mine, theirs = _halves(plan)
    board: dict = {}
    assert write_and_commit(fs, root, plan, metadata=None, files=theirs, exchange=_Exchange(board, 1)) is None
    assert MANIFEST_NAME not in files(str(tmp_path / "h"))  # a rank but 0 never commits
    assert all(isinstance(r, ShardRecord) for r in board[1][0].values())
    done = write_and_commit(fs, root, plan, metadata=None, files=mine, exchange=_Exchange(board, 0))
    assert set(done.manifest["shards"]) == set(plan.shards)
    assert_bitwise_equal(load_state_dict(str(tmp_path / "h")), values)


def test_a_rank_whose_share_failed_posts_it_and_rank_0_deletes_every_shard_naming_that_rank(tmp_path):
    uri = str(tmp_path / "h")
    before = save_state_dict(_values(1), uri, max_shard_size=200)
    fs, root = resolve(uri)
    plan = plan_handoff(_values(2), max_shard_size=200, taken=set(before["shards"]))
    mine, theirs = _halves(plan)
    board: dict = {}
    broken = dict(plan.state_dict)
    del broken[plan.shards[theirs[0]][0]]  # rank 1 cannot read one of its tensors
    with pytest.raises(KeyError):
        write_and_commit(fs, root, dataclasses.replace(plan, state_dict=broken), metadata=None, files=theirs,
                         exchange=_Exchange(board, 1))
    assert board[1][1] is not None  # posted before it was raised
    with pytest.raises(StorageTransferError, match=r"rank 1: .*nothing was committed"):
        write_and_commit(fs, root, plan, metadata=None, files=mine, exchange=_Exchange(board, 0))
    assert files(uri) == {*before["shards"], MANIFEST_NAME, INDEX_NAME}  # the handoff there before, unchanged
    assert_bitwise_equal(load_state_dict(uri), _values(1))


def test_a_rank_that_never_answers_fails_rank_0_with_the_waits_error_and_leaves_nothing(tmp_path):
    uri = str(tmp_path / "h")
    fs, root = resolve(uri)
    plan = plan_handoff(_values(), max_shard_size=200)
    mine, _ = _halves(plan)
    with pytest.raises(TimeoutError, match="rank 1 did not answer"):
        write_and_commit(fs, root, plan, metadata=None, files=mine, exchange=_Exchange({}, 0))
    assert files(uri) == set()
