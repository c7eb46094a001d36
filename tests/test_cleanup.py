"""What may be deleted in a handoff's folder: leftovers of killed writers once old, never a live file; and a
folder holding a handoff refused unless the caller asks to replace it."""

from __future__ import annotations

import pytest
from _handoffs import INDEX, MANIFEST, age, files, model_dict, read, url, write
from _tensors import assert_bitwise_equal

from stagesafe.errors import HandoffExistsError
from stagesafe.handoff.cleanup import ORPHAN_AGE, remove_stale
from stagesafe.handoff.read import load_state_dict, read_manifest
from stagesafe.publishing.save import save_state_dict


def test_removing_stale_files_never_raises(caplog):
    with caplog.at_level("WARNING", logger="stagesafe.handoff.cleanup"):
        remove_stale("nosuchprotocol://bucket/weights")  # the store cannot even be opened
    assert "could not delete stale files under nosuchprotocol://bucket/weights" in caplog.text


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
