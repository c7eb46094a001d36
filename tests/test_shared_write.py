"""A handoff written by several ranks at once (stagesafe/stages/shared_write.py): which rank writes which shard,
planned from plain specs; and the write itself, two ranks as two threads of this process, each with its
channel on one real key-value store, writing real files."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _launch import on_every_rank, store_channels
from _tensors import Unwritable, assert_bitwise_equal

import stagesafe
from stagesafe.errors import StorageTransferError
from stagesafe.publishing.commit import Commit
from stagesafe.handoff.plan import plan_specs
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.stages.channel import Outcome
from stagesafe.stages.shared_write import names_written_by, owners, write_share

pytestmark = pytest.mark.timeout(120)

_PREFIX = "stagesafe/test/write-1"  # the keys of one write; their prefix tags the shard names


def _specs(*floats: int) -> dict[str, dict]:
    return {f"t{i}": {"dtype": "float32", "shape": [n]} for i, n in enumerate(floats)}


def test_the_largest_shard_goes_first_to_the_rank_with_the_fewest_bytes():
    plan = plan_specs(_specs(100, 75, 50, 25, 25), {}, max_shard_size=1)  # one shard per tensor: 400 ... 100 bytes
    files = list(plan.shards)
    assert list(owners(plan, 2)) == files  # in the plan's order
    assert list(owners(plan, 2).values()) == [0, 1, 1, 0, 0]  # loads 600 and 500; a tie goes to the lower rank
    assert list(owners(plan, 3).values()) == [0, 1, 2, 2, 1]  # loads 400, 400, 300
    assert set(owners(plan, 1).values()) == {0}


def test_shards_of_one_size_are_dealt_in_the_plans_order():
    plan = plan_specs(_specs(10, 10, 10, 10, 10), {}, max_shard_size=1)
    assert list(owners(plan, 2).values()) == [0, 1, 0, 1, 0]


def test_the_writing_ranks_share_the_stored_names_and_the_others_write_none():
    specs = _specs(100, 75, 50, 25, 25) | {"tied": {"dtype": "float32", "shape": [100]}}
    aliases = {"tied": "t0"}  # stored under t0
    plan = plan_specs(specs, aliases, max_shard_size=1)
    shares = [names_written_by(plan, rank=r, writers=2) for r in range(3)]
    assert shares == [{"t0", "t3", "t4"}, {"t1", "t2"}, set()]
    assert names_written_by(plan, rank=0, writers=1) == {"t0", "t1", "t2", "t3", "t4"}


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"w{i}": torch.randn(40 + 10 * i, generator=g) for i in range(5)}


def _share(uri: str, values: dict, channel) -> Commit | None:
    return write_share(values, plan_handoff(values, max_shard_size=1), uri, None, channel=channel, writers=2,
                       metadata={"step": 3})


def _shards_in(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) if os.path.isdir(folder) else []


def test_each_rank_posts_its_shards_as_data_and_rank_zero_commits_them_all(tmp_path):
    uri, values, channels = str(tmp_path / "h"), _values(), store_channels(2, prefix=_PREFIX)
    commit, none = on_every_rank(lambda r: _share(uri, values, channels[r]), 2)
    assert none is None and isinstance(commit, Commit) and commit.manifest["metadata"] == {"step": 3}
    assert_bitwise_equal(stagesafe.load_state_dict(uri), values)
    posted = channels[0].outcome("shards/1")  # what rank 1 told rank 0: its files and their checksums
    assert posted.ok and set(posted.value) == {commit.manifest["weight_map"][name] for name in _written_by(1)}
    for file, (digest, hexdigest, size) in posted.value.items():
        assert commit.manifest["shards"][file] == {digest: hexdigest, "size": size}


def _written_by(rank: int) -> set[str]:
    specs = {name: {"dtype": "float32", "shape": list(t.shape)} for name, t in _values().items()}
    return names_written_by(plan_specs(specs, {}, max_shard_size=1), rank=rank, writers=2)


def _values_failing_on(rank: int) -> dict[str, torch.Tensor]:
    """The values, one of those ``rank`` writes unwritable: that rank's share fails."""
    values = _values()
    name = min(_written_by(rank))
    return values | {name: Unwritable(values[name])}


def test_a_failed_share_is_posted_as_its_error_and_rank_zero_deletes_every_shard(tmp_path):
    uri, channels = str(tmp_path / "h"), store_channels(2, prefix=_PREFIX)
    zero, one = on_every_rank(lambda r: _share(uri, _values_failing_on(1) if r == 1 else _values(), channels[r]), 2)
    assert isinstance(one, RuntimeError) and str(one) == "this tensor cannot be written"
    assert channels[0].outcome("shards/1") == Outcome(error="RuntimeError: this tensor cannot be written")
    assert isinstance(zero, StorageTransferError)
    assert "on rank 1: RuntimeError: this tensor cannot be written; nothing was committed" in str(zero)
    assert _shards_in(uri) == [] and not os.path.exists(os.path.join(uri, "stagesafe.json"))


def test_rank_zero_whose_own_share_failed_waits_for_the_others_shards_before_deleting_them(tmp_path):
    uri, channels = str(tmp_path / "h"), store_channels(2, prefix=_PREFIX)

    def rank(r: int):
        if r == 1:
            time.sleep(1.0)  # rank 1 writes its shards after rank 0's own share has failed
        return _share(uri, _values_failing_on(0) if r == 0 else _values(), channels[r])

    zero, one = on_every_rank(rank, 2)
    assert isinstance(zero, RuntimeError) and str(zero) == "this tensor cannot be written"
    assert one is None  # rank 1's share was written and posted
    assert _shards_in(uri) == []  # and then deleted by rank 0: nothing of the failed write is left
