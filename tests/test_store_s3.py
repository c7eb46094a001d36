"""The handoff store on s3:// through s3fs, against moto's S3 server on loopback (tests/_s3.py): round trips,
parallel transfers, replacement, corruption, a missing bucket, and retries on a server that fails for real
(error answers, a server stopped and started again, a server gone for good mid-upload)."""

from __future__ import annotations

import re

import json
import threading
import time
from collections.abc import Mapping

import pytest
import safetensors.torch
import torch
from _tensors import assert_bitwise_equal

from stagesafe.errors import (
    HandoffCorruptError,
    HandoffExistsError,
    HandoffNotFoundError,
    StorageTransferError,
)
from stagesafe.handoff.cleanup import remove_stale
from stagesafe.handoff.digest import DEFAULT, hash_buffer
from stagesafe.handoff.read import load_state_dict, read_manifest
from stagesafe.storage.retry import RetryPolicy
from stagesafe.publishing.save import save_state_dict
from stagesafe.publishing.verify import verify

pytestmark = pytest.mark.timeout(60)

INDEX, MANIFEST = "model.safetensors.index.json", "stagesafe.json"
SHARD = r"/model-[^/]*\.safetensors$"
QUICK = RetryPolicy(attempts=3, initial_delay=0.05, max_delay=0.1)  # gives up within about 0.15 s


def model_dict(seed: int, n: int = 6, numel: int = 100) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)}




def test_round_trip_on_s3_is_bitwise_and_the_objects_are_a_hugging_face_folder(s3):
    url, opts = s3.new_url(), s3.storage_options()
    nan_payloads = torch.tensor([0x7FC00001, 0x80000000 - 2**32, 0x7F800000, 1], dtype=torch.int32)
    embedding = torch.randn(11, 4)
    sd = {
        "embed.weight": embedding,
        "float32_nan_payloads": nan_payloads.view(torch.float32),
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "int64": torch.arange(-3, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 2),
        "lm_head.weight": embedding,  # tied: stored once
    }
    manifest = save_state_dict(sd, url, storage_options=opts, max_shard_size=100, metadata={"stage": "fit"})
    objects = s3.objects(url)
    assert set(objects) == {*manifest["shards"], INDEX, MANIFEST} and len(manifest["shards"]) >= 3
    assert json.loads(objects[MANIFEST]) == manifest == read_manifest(url, storage_options=opts)
    assert json.loads(objects[INDEX])["weight_map"] == manifest["weight_map"]
    for name, rec in manifest["shards"].items():  # what S3 holds is what the manifest describes
        assert rec == {DEFAULT: hash_buffer(DEFAULT, objects[name]), "size": len(objects[name])}
        safetensors.torch.load(objects[name])
    loaded = load_state_dict(url, storage_options=opts)
    assert_bitwise_equal(loaded, sd)
    assert loaded["lm_head.weight"] is loaded["embed.weight"]
    assert verify(url, storage_options=opts) == manifest


def test_shards_travel_in_parallel_at_most_workers_at_a_time(s3):
    url, opts = s3.new_url(), s3.storage_options()
    sd = model_dict(1, n=8)  # 400 bytes each: 8 shards of one tensor
    s3.delay("PUT", SHARD, 0.2)
    s3.delay("GET", SHARD, 0.2)
    with s3.traffic() as up:
        manifest = save_state_dict(sd, url, storage_options=opts, max_shard_size=400)  # default: 4 at a time
    assert len(manifest["shards"]) == 8 and len(up.paths("PUT", SHARD)) == 8
    assert up.max_in_flight("PUT", SHARD) == 4
    with s3.traffic() as down:
        assert_bitwise_equal(load_state_dict(url, storage_options=opts, workers=3), sd)
    assert len(down.paths("GET", SHARD)) == 8 and down.max_in_flight("GET", SHARD) == 3
    with s3.traffic() as one:
        save_state_dict(sd, url, storage_options=opts, max_shard_size=400, workers=1, overwrite=True)
    assert one.max_in_flight("PUT", SHARD) == 1
    # The manifest is written last, after every shard is in place.
    assert up.paths("PUT")[-1].endswith(INDEX) and up.paths("PUT")[-2].endswith(MANIFEST)  # the index follows the commit


def test_a_second_save_replaces_the_first_and_leaves_no_stale_object(s3):
    url, opts = s3.new_url(), s3.storage_options()
    first = save_state_dict(model_dict(1, n=6), url, storage_options=opts, max_shard_size=800)  # 3 shards
    sd2 = model_dict(2, n=4)
    # 2 shards, tagged names
    second = save_state_dict(sd2, url, storage_options=opts, max_shard_size=800, overwrite=True)
    assert set(second["shards"]).isdisjoint(first["shards"])
    assert set(s3.objects(url)) == {*second["shards"], INDEX, MANIFEST}
    assert_bitwise_equal(load_state_dict(url, storage_options=opts), sd2)
    sd3 = model_dict(3, n=1)
    third = save_state_dict(sd3, url, storage_options=opts, overwrite=True)
    assert set(s3.objects(url)) == {*third["shards"], INDEX, MANIFEST}
    assert_bitwise_equal(load_state_dict(url, storage_options=opts), sd3)
    verify(url, storage_options=opts)


def test_a_shard_object_no_commit_names_is_left_while_young_and_deleted_once_old(s3):
    """A killed writer's completed upload: a shard object that no commit names. Its age is S3's LastModified
    (the server's clock cannot be set back, so the age limit is lowered instead of the object aged)."""
    url, opts = s3.new_url(), s3.storage_options()
    saved = save_state_dict(model_dict(1), url, storage_options=opts, max_shard_size=800)
    stray = "model-0badcafe-00001-of-00003.safetensors"
    s3.put(url, stray, b"junk")
    remove_stale(url, storage_options=opts)  # young: perhaps another writer's commit in progress
    assert stray in s3.objects(url)
    remove_stale(url, storage_options=opts, older_than=0)
    assert set(s3.objects(url)) == {*saved["shards"], INDEX, MANIFEST}
    assert_bitwise_equal(load_state_dict(url, storage_options=opts), model_dict(1))


def test_overwrite_false_refuses_an_existing_handoff(s3):
    url, opts = s3.new_url(), s3.storage_options()
    sd = model_dict(1)
    save_state_dict(sd, url, storage_options=opts, overwrite=False)
    with pytest.raises(HandoffExistsError, match="pass overwrite=True"):
        save_state_dict(model_dict(2), url, storage_options=opts, overwrite=False)
    assert_bitwise_equal(load_state_dict(url, storage_options=opts), sd)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_object_is_refused_naming_the_shard(s3, damage):
    url, opts = s3.new_url(), s3.storage_options()
    shard = list(save_state_dict(model_dict(5), url, storage_options=opts, max_shard_size=800)["shards"])[1]
    data = bytearray(s3.objects(url)[shard])
    if damage == "flip":
        data[-7] ^= 0xFF  # inside the tensor data: the safetensors header is intact
        s3.put(url, shard, bytes(data))
    elif damage == "truncate":
        s3.put(url, shard, bytes(data[:-10]))
    else:
        bucket, prefix = url.removeprefix("s3://").split("/", 1)
        s3.client().delete_object(Bucket=bucket, Key=f"{prefix}/{shard}")
    expected = {"flip": f"has {DEFAULT}", "truncate": "bytes, the manifest says", "delete": "missing"}[damage]
    for reader in (verify, load_state_dict):
        with pytest.raises(HandoffCorruptError, match=expected) as info:
            reader(url, storage_options=opts)
        assert repr(shard) in str(info.value) and url in str(info.value)


def test_a_missing_bucket_is_named(s3):
    url, opts = "s3://no-such-bucket-stagesafe/run/handoff", s3.storage_options()
    with pytest.raises(StorageTransferError, match=r"bucket or folder it goes into does not exist") as info:
        save_state_dict(model_dict(1), url, storage_options=opts, retry=QUICK)
    assert re.search(r"model-[0-9a-f]{8}-00001-of-00001\.safetensors", str(info.value)) and url in str(info.value)
    assert isinstance(info.value, OSError)
    with pytest.raises(HandoffNotFoundError, match=r"the bucket 'no-such-bucket-stagesafe' does not exist"):
        load_state_dict(url, storage_options=opts)


def test_not_found_hints_on_s3(s3):
    url, opts = s3.new_url(), s3.storage_options()
    with pytest.raises(HandoffNotFoundError, match="Is this the right folder"):
        load_state_dict(url, storage_options=opts)
    save_state_dict(model_dict(1), url, storage_options=opts)
    s3.put(url, "sub/notes.txt", b"x")
    with pytest.raises(HandoffNotFoundError, match=r"sub-folder of the handoff .*: pass its parent"):
        read_manifest(f"{url}/sub", storage_options=opts)
    with pytest.raises(HandoffNotFoundError, match=r"sub-folders \['handoff'\] hold handoffs"):
        read_manifest(url.rsplit("/", 1)[0], storage_options=opts)


def test_server_errors_are_retried_and_access_denied_is_not(s3, caplog):
    url, opts = s3.new_url(), s3.storage_options()
    sd = model_dict(1, n=4)
    s3.fail("PUT", r"/model-[0-9a-f]{8}-00002-of-00002\.safetensors$", 500, "InternalError", times=2)
    s3.fail("GET", r"/model-[0-9a-f]{8}-00001-of-00002\.safetensors$", 503, "SlowDown", times=1)
    with s3.traffic() as seen:
        save_state_dict(sd, url, storage_options=opts, max_shard_size=800, retry=QUICK)
        assert_bitwise_equal(load_state_dict(url, storage_options=opts, retry=QUICK), sd)
    assert len(seen.paths("PUT", "00002-of-00002")) == 3  # two 500s, then stored
    assert len(seen.paths("GET", "00001-of-00002")) >= 2  # s3fs retries SlowDown itself; stagesafe would too
    assert re.search(r"could not write shard 'model-[0-9a-f]{8}-00002-of-00002\.safetensors'", caplog.text)
    assert "trying again" in caplog.text

    s3.fail("PUT", r"/model-[^/]*00001-of-00002\.safetensors$", 403, "AccessDenied")
    with s3.traffic() as seen, pytest.raises(StorageTransferError, match="access denied") as info:
        save_state_dict(model_dict(2, n=4), url, storage_options=opts, max_shard_size=800, retry=QUICK, overwrite=True)
    assert len(seen.paths("PUT", "00001-of-00002")) == 1  # refused once, not asked again
    assert "00001-of-00002.safetensors" in str(info.value) and url in str(info.value)
    s3.clear_rules()
    assert_bitwise_equal(load_state_dict(url, storage_options=opts), sd)
    assert set(s3.objects(url)) == {*read_manifest(url, storage_options=opts)["shards"], INDEX, MANIFEST}


def test_a_save_waits_for_a_server_that_comes_back(s3, caplog):
    url, opts = s3.new_url(), s3.storage_options()
    save_state_dict(model_dict(1), url, storage_options=opts, max_shard_size=800)
    sd = model_dict(2)
    patient = RetryPolicy(attempts=10, initial_delay=0.1, max_delay=1.0)  # waits at least 3 s before giving up
    outcome = {}

    def save():
        try:
            outcome["manifest"] = save_state_dict(
                sd, url, storage_options=opts, max_shard_size=800, retry=patient, overwrite=True
            )
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            outcome["error"] = exc

    s3.stop()
    saver = threading.Thread(target=save)
    saver.start()
    time.sleep(0.5)  # the save's first requests are refused: nothing listens on the port
    assert saver.is_alive()
    s3.start()
    saver.join(timeout=30)
    assert "error" not in outcome, outcome.get("error")
    assert "trying again" in caplog.text and "Could not connect to the endpoint URL" in caplog.text
    assert_bitwise_equal(load_state_dict(url, storage_options=opts), sd)
    assert set(s3.objects(url)) == {*outcome["manifest"]["shards"], INDEX, MANIFEST}


def test_a_server_gone_for_good_mid_upload_fails_the_save_and_keeps_the_old_handoff(s3):
    url, opts = s3.new_url(), s3.storage_options()
    sd1 = model_dict(1)
    old = save_state_dict(sd1, url, storage_options=opts, max_shard_size=800)
    s3.stop_on("PUT", SHARD)  # the first shard upload takes the server down
    with pytest.raises(StorageTransferError, match=r"could not write shard 'model-[0-9a-f]{8}-0000\d-of-00003") as info:
        save_state_dict(model_dict(2), url, storage_options=opts, max_shard_size=800, retry=QUICK, overwrite=True)
    message = str(info.value)
    assert url in message and "3 tries" in message and "the handoff there before, if any, is unchanged" in message
    assert not s3.running
    with pytest.raises(StorageTransferError, match=f"could not read {url}/stagesafe.json"):
        load_state_dict(url, storage_options=opts, retry=QUICK)
    s3.start()
    assert_bitwise_equal(load_state_dict(url, storage_options=opts), sd1)
    assert verify(url, storage_options=opts) == old
    sd3 = model_dict(3)
    new = save_state_dict(sd3, url, storage_options=opts, max_shard_size=800, overwrite=True)
    assert set(s3.objects(url)) == {*new["shards"], INDEX, MANIFEST}  # anything the failed save left is gone
    assert_bitwise_equal(load_state_dict(url, storage_options=opts), sd3)
