"""Two processes writing one handoff folder at the same moment, and readers while a writer replaces it.

The last commit wins whole: unique shard names per commit, the manifest as the one atomic switch, the index
made to follow it, and no writer deleting another commit's shards; readers start over when the handoff is
replaced under them. Real processes on a real folder (and memory:// for the readers' test of threads).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading

import pytest
import torch

import stagesafe
from stagesafe.errors import HandoffCorruptError, HandoffNotReadyError

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
ROUNDS = 20


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(200, 50, generator=g) for i in range(8)}


def _writer(uri: str, seed: int, barrier, rounds: int, errors) -> None:
    torch.set_num_threads(1)
    for r in range(rounds):
        barrier.wait(60)
        try:
            stagesafe.save_state_dict(_state(seed * 1000 + r), uri, max_shard_size="100KB", overwrite=True)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.put(f"writer {seed} round {r}: {type(exc).__name__}: {exc}")
        barrier.wait(60)  # the test looks at the folder between rounds


def test_two_processes_saving_at_once_always_leave_one_whole_handoff(tmp_path):
    uri = str(tmp_path / "handoff")
    ctx = multiprocessing.get_context("spawn")
    barrier, errors = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(uri, seed, barrier, ROUNDS, errors)) for seed in (1, 2)]
    for p in procs:
        p.start()
    winners = []
    try:
        for r in range(ROUNDS):
            barrier.wait(120)  # both start saving
            barrier.wait(120)  # both are done
            manifest = stagesafe.verify(uri)  # shards, sizes, hashes and the index all agree
            loaded = stagesafe.load_state_dict(uri)
            candidates = {seed: _state(seed * 1000 + r) for seed in (1, 2)}
            won = [s for s, sd in candidates.items() if all(torch.equal(loaded[k], v) for k, v in sd.items())]
            assert len(won) == 1, f"round {r}: the handoff is neither writer's whole state dict"
            assert set(manifest["shards"]) <= set(os.listdir(uri))
            winners.append(won[0])
    finally:
        for p in procs:
            p.join(60)
    assert errors.empty(), errors.get()
    assert all(p.exitcode == 0 for p in procs)


def test_readers_never_take_a_handoff_being_replaced_for_a_damaged_one(tmp_path):
    uri = str(tmp_path / "handoff")
    stagesafe.save_state_dict(_state(0), uri, max_shard_size="100KB")
    stop = threading.Event()
    commits = []

    def replace() -> None:
        n = 1
        while not stop.is_set():
            stagesafe.save_state_dict(_state(n % 2), uri, max_shard_size="100KB", overwrite=True)
            commits.append(n)
            n += 1

    writer = threading.Thread(target=replace)
    writer.start()
    corrupt, busy, whole = [], 0, 0
    try:
        while len(commits) < 40 or whole + busy + len(corrupt) < 20:  # that many reads too, whichever is faster
            try:
                stagesafe.verify(uri)
                loaded = stagesafe.load_state_dict(uri)
                assert any(all(torch.equal(loaded[k], v) for k, v in _state(s).items()) for s in (0, 1))
                whole += 1
            except HandoffNotReadyError:  # every attempt met a newer handoff: said so, not called damaged
                busy += 1
            except HandoffCorruptError as exc:
                corrupt.append(str(exc))
    finally:
        stop.set()
        writer.join(60)
    checks = whole + busy + len(corrupt)
    assert corrupt == [], f"{len(corrupt)} of {checks} reads called a healthy handoff damaged: {corrupt[0]}"
    assert whole > 0 and checks > 10


def _replace_before_open(monkeypatch, path: str, times: int) -> list[int]:
    """Rename a copy of ``path`` over it just before each of its first ``times`` opens: the window between a
    reader's check of the file and its open, where a writer's commit lands, made certain instead of likely."""
    real_open, swaps = os.open, []

    def open_after_a_commit(file, flags, *args, **kwargs):
        if os.fspath(file) == path and len(swaps) < times:
            copy = path + ".next"
            with open(path, "rb") as src, open(copy, "wb") as dst:
                dst.write(src.read())
            os.replace(copy, path)  # a new inode under the same name, as a commit leaves it
            swaps.append(1)
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_after_a_commit)
    return swaps


def test_a_manifest_committed_between_the_check_and_the_open_is_opened_again(tmp_path, monkeypatch):
    uri = str(tmp_path / "handoff")
    stagesafe.save_state_dict(_state(0), uri)
    swaps = _replace_before_open(monkeypatch, os.path.realpath(os.path.join(uri, "stagesafe.json")), times=2)
    loaded = stagesafe.load_state_dict(uri)
    assert len(swaps) == 2
    assert all(torch.equal(loaded[k], v) for k, v in _state(0).items())


def test_a_file_replaced_at_every_open_is_refused_naming_the_race(tmp_path, monkeypatch):
    uri = str(tmp_path / "handoff")
    stagesafe.save_state_dict(_state(0), uri)
    _replace_before_open(monkeypatch, os.path.realpath(os.path.join(uri, "stagesafe.json")), times=10**6)
    with pytest.raises(HandoffCorruptError, match="replaced 3 times while being opened"):
        stagesafe.read_manifest(uri)


def _commit_after_each_shard_open(monkeypatch, uri: str, rounds: int) -> list[str]:
    """Right after a reader opens the shard of ``uri`` (one shard; once for each handoff, ``rounds`` at most),
    another writer commits a new handoff there, rewriting the index and deleting the shard it replaced: the
    race a writer saving in a loop makes, at the worst moment for the reader, every time instead of sometimes."""
    real_open, opened = os.open, []
    folder = os.path.realpath(uri)

    def open_then_commit(file, flags, *args, **kwargs):
        fd = real_open(file, flags, *args, **kwargs)
        path = os.fspath(file)
        if os.path.dirname(path) == folder and path.endswith(".safetensors") and path not in opened:
            if len(opened) < rounds:
                opened.append(path)
                stagesafe.save_state_dict(_state(len(opened)), uri, overwrite=True)
        return fd

    monkeypatch.setattr(os, "open", open_then_commit)
    return opened


@pytest.mark.parametrize("reader", ["verify", "load_state_dict"])
def test_a_handoff_replaced_while_its_shards_are_read_is_read_whole_by_verify_as_by_a_load(tmp_path, monkeypatch, reader):
    uri = str(tmp_path / "handoff")
    stagesafe.save_state_dict(_state(0), uri)
    commits = _commit_after_each_shard_open(monkeypatch, uri, rounds=3)
    if reader == "verify":
        assert stagesafe.verify(uri)["shards"]  # the index is read with the manifest, not after the shards
    else:
        assert set(stagesafe.load_state_dict(uri)) == set(_state(0))
    assert len(commits) == 1  # read whole at the first attempt, as the shard's descriptor was open


def test_fix_index_never_writes_the_index_of_a_manifest_a_commit_replaced_while_it_verified(tmp_path, monkeypatch):
    """``verify --fix-index`` on a handoff whose index is damaged, while another writer commits a new handoff
    there (right after verify opens the old shard): the index ends up the new commit's, never the old one's."""
    uri = str(tmp_path / "handoff")
    old = stagesafe.save_state_dict(_state(0), uri)
    index_path = os.path.join(uri, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["metadata"]["total_size"] += 1  # damaged
    with open(index_path, "w") as f:
        json.dump(index, f)
    commits = _commit_after_each_shard_open(monkeypatch, uri, rounds=1)
    verified = stagesafe.verify(uri, fix_index=True)
    monkeypatch.undo()
    now = stagesafe.read_manifest(uri)
    assert len(commits) == 1 and now != old
    assert verified == now  # verify went on to the handoff committed now
    with open(index_path) as f:
        assert json.load(f)["weight_map"] == now["weight_map"]
    assert stagesafe.verify(uri) == now


def test_a_handoff_replaced_before_every_read_of_a_shard_is_said_busy_not_damaged(tmp_path, monkeypatch):
    uri = str(tmp_path / "handoff")
    stagesafe.save_state_dict(_state(0), uri)
    real_open, folder, commits = os.open, os.path.realpath(uri), []

    def commit_then_open(file, flags, *args, **kwargs):
        path = os.fspath(file)
        if os.path.dirname(path) == folder and path.endswith(".safetensors"):
            commits.append(path)  # a writer saving in a loop wins the race at every attempt
            stagesafe.save_state_dict(_state(len(commits) % 2), uri, overwrite=True)
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", commit_then_open)
    with pytest.raises(HandoffNotReadyError, match="replaced 8 times while being read; read it again once"):
        stagesafe.load_state_dict(uri)
    assert len(commits) == 8
    monkeypatch.setattr(os, "open", real_open)
    assert stagesafe.verify(uri)["shards"]  # the handoff itself was whole all along
