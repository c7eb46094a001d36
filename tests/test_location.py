"""stages/location.py: which ranks see rank 0's handoff folder, so which ranks write shares of a handoff.
Two gloo ranks in this test run, each with the folder it is given."""

from __future__ import annotations

import os

import pytest
from _launch import two_ranks  # noqa: F401 - a fixture

from stagesafe.errors import DistributedStageError, StorageBackendError, StorageTransferError
from stagesafe.stages import collectives
from stagesafe.stages.history import HandoffTarget
from stagesafe.stages.location import Location, agree_on_location

pytestmark = pytest.mark.timeout(120)


def _agree(folders: list[str]) -> Location:
    """Each rank agrees with ``folders[rank]`` as its handoff folder."""
    return agree_on_location(HandoffTarget(uri=folders[collectives.rank()]))


def test_ranks_that_see_one_folder_all_write(two_ranks, tmp_path):
    shared = str(tmp_path / "handoff")
    one, other = two_ranks.run(_agree, [shared, shared])
    assert one == other
    assert one.writers == 2 and one.folders == (shared, shared)
    assert len(one.writer_id) == 16
    assert os.listdir(shared) == []  # rank 0's token is gone once every rank has looked


def test_ranks_with_folders_of_their_own_leave_rank_0_to_write(two_ranks, tmp_path):
    mine, yours = str(tmp_path / "rank0"), str(tmp_path / "rank1")
    one, other = two_ranks.run(_agree, [mine, yours])
    assert one == other
    assert one.writers == 1 and one.folders == (mine, yours)
    assert os.listdir(mine) == [] and not os.path.exists(yours)  # only rank 0 writes


def test_one_url_that_is_not_one_folder_is_seen_as_folders_of_their_own(two_ranks):
    # memory:// is each process's own, as a node-local disk is each node's
    one, other = two_ranks.run(_agree, ["memory://stagesafe/handoff"] * 2)
    assert one.writers == other.writers == 1
    assert one.folders == ("memory:///stagesafe/handoff",) * 2


def test_a_folder_rank_0_cannot_write_fails_every_rank(two_ranks, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("a file where rank 0's folder should be")
    own, told = two_ranks.run(_agree, [str(blocked / "handoff"), str(tmp_path / "rank1")])
    assert isinstance(own, StorageTransferError), own
    assert isinstance(told, DistributedStageError), told
    assert list(told.failures) == [0] and told.failures[0].startswith("StorageTransferError: could not write to")


def test_a_folder_rank_1_cannot_open_fails_every_rank(two_ranks, tmp_path):
    own, told = two_ranks.run(_agree, [str(tmp_path / "handoff"), "nosuchprotocol://handoff"])
    assert isinstance(told, StorageBackendError), told  # rank 1's own error
    assert isinstance(own, DistributedStageError), own  # rank 0 is told, not left waiting
    assert list(own.failures) == [1] and "no filesystem is known for protocol 'nosuchprotocol'" in own.failures[1]
    assert os.listdir(tmp_path / "handoff") == []


def test_one_process_writes_alone(tmp_path):
    location = agree_on_location(HandoffTarget(uri=str(tmp_path / "handoff")))
    assert (location.writers, location.folders) == (1, (str(tmp_path / "handoff"),))
