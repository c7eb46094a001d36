"""handoff/names.py: which file of a handoff folder is what, decided in one place."""

from __future__ import annotations

import pytest
from _pure import PURE, imports_of

import stagesafe.handoff.names
from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff.names import (
    is_commit_of,
    is_shard_name,
    is_temp_name,
    scratch_name,
    shard_file_names,
    tag_for,
)
from stagesafe.storage.temp_names import temp_name


def test_it_imports_neither_torch_nor_fsspec():
    assert imports_of(stagesafe.handoff.names) <= PURE


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


def test_a_handoff_says_whether_it_is_the_commit_of_a_write():
    key = "stagesafe/ab12/write-3"
    ours = shard_file_names(2, tag=tag_for(key))
    assert is_commit_of(ours, key)
    assert not is_commit_of(ours, "stagesafe/ab12/write-4")  # a later write's commit is another one
    assert not is_commit_of(shard_file_names(2), key) and not is_commit_of([], key)
    assert not is_commit_of(["model-00001-of-00001.safetensors"], key)  # an older handoff's plain names
