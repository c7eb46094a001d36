"""A handoff's folder: the probes made before any stage, the storage calls every step makes (refusals named,
best-effort deletion) and the parallel loop over shards."""

from __future__ import annotations

import threading
import uuid

import pytest
from _handoffs import files

from stagesafe.errors import StorageTransferError
from stagesafe.storage.folder import Folder, each
from stagesafe.storage.fs import resolve
from stagesafe.storage.retry import RetryPolicy


def test_check_writable_fails_early_and_leaves_nothing(tmp_path):
    from stagesafe.storage.folder import check_writable

    url = str(tmp_path / "handoff")
    check_writable(url, "probe.tmp-0")
    assert files(url) == set()  # the probe file is gone
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(StorageTransferError, match="a_file"):
        check_writable(str(blocker / "handoff"), "probe.tmp-0")


def test_remove_deletes_the_files_named_and_an_emptied_folder_only_when_asked(tmp_path, caplog):
    fs, root = resolve(str(tmp_path / "h"))
    folder = Folder(fs, root)
    fs.makedirs(root)
    for name in ("a", "b", "c", "keep"):
        fs.pipe_file(folder.path(name), name.encode())
    folder.remove(["a", "b", "gone"], empty_root=True)  # a missing file is no error; "keep" keeps the folder
    assert files(str(tmp_path / "h")) == {"c", "keep"} and caplog.text == ""
    folder.remove(["c", "keep"])
    assert fs.isdir(root) and files(str(tmp_path / "h")) == set()  # emptied, but not asked to go
    folder.remove([], empty_root=True)
    assert not fs.exists(root)


def test_transfer_names_a_refusal_and_says_what_to_do(tmp_path):
    folder = Folder.at(str(tmp_path / "h"), retry=RetryPolicy(attempts=1))
    assert folder.url == str(tmp_path / "h") and folder.path("x") == f"{tmp_path}/h/x"

    def denied():
        raise PermissionError(13, "Permission denied")

    with pytest.raises(StorageTransferError, match="could not write x: access denied .* may write there") as local:
        folder.transfer(denied, what="write x", hint="; later", writing=True)
    assert "folder's permissions" in str(local.value) and "credentials" not in str(local.value)
    assert str(local.value).endswith("; later")
    remote = Folder.at(f"memory:///stagesafe-tests/{uuid.uuid4().hex}", retry=RetryPolicy(attempts=1))
    with pytest.raises(StorageTransferError, match="check the credentials in storage_options .* may read there"):
        remote.transfer(denied, what="read x")
    with pytest.raises(StorageTransferError, match="could not write x: the bucket or folder it goes into does not"):
        folder.transfer(lambda: open(tmp_path / "no" / "x"), what="write x", writing=True)
    with pytest.raises(FileNotFoundError):  # a read: the caller knows what a missing file means
        folder.transfer(lambda: open(tmp_path / "no" / "x"), what="read x")
    assert folder.transfer(lambda: 7, what="count") == 7


def test_each_runs_a_few_at_a_time_and_raises_the_earliest_failure_once_the_others_stopped():
    lock, running, most, stopped = threading.Lock(), [0], [0], []

    def fn(item: str, stop: threading.Event) -> str:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            if item in ("c", "e"):
                raise ValueError(f"bad {item}")
            if item == "b":  # a slow transfer, still retrying when the others fail
                stopped.append(stop.wait(10))
            return item.upper()
        finally:
            with lock:
                running[0] -= 1

    items = list("abcdefgh")
    assert each(list("abcd"), lambda item, stop: item * 2, 3) == {"a": "aa", "b": "bb", "c": "cc", "d": "dd"}
    with pytest.raises(ValueError, match="bad c"):  # as a loop over the items would have raised it
        each(items, fn, 3)
    assert most[0] <= 3 and stopped == [True]  # told to stop, not left to time out
    assert not [t for t in threading.enumerate() if t.name.startswith("stagesafe-transfer")]
    with pytest.raises(ValueError, match="bad c"):
        each(["a", "c", "b"], fn, 1)  # one at a time: a plain loop, which ends at the first failure
    assert stopped == [True]
