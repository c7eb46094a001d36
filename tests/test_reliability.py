"""Faults and bad input never lose a handoff: killed writers, writes that fail for real, damaged handoffs,
handoffs that do not fit, interrupted and failing stages, a failure on one rank only.

Every fault here is real: a process killed with SIGKILL, a file-size limit, a read-only or full filesystem, a
folder the writer may not write, an S3 server that stops, SIGINT in the middle of ``training_step``. Nothing
inside stagesafe is patched; the killed writer only chooses *when* it dies. ``docs/reliability.md`` lists every
case with its outcome. Tests marked ``xfail(strict=True)`` show a protection that is missing: each says what
breaks.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from _tensors import assert_bitwise_equal, bits
from _launch import run_ranks, run_script, sanitized_env
from torch import nn

from stagesafe import load_state_dict, read_manifest, restore, save_state_dict, verify
from stagesafe.storage.fs import list_files, resolve
from stagesafe.cli import main as cli_main
from stagesafe.errors import (
    HandoffCorruptError,
    HandoffNotReadyError,
    InvalidArgumentError,
    StorageTransferError,
)
from stagesafe.handoff.manifest import manifest_checksum
from stagesafe.handoff.cleanup import ORPHAN_AGE
from stagesafe.storage.retry import RetryPolicy

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
sys.path.insert(0, SCRIPTS)
from faulty_writer import big_state_dict

WRITER = os.path.join(SCRIPTS, "faulty_writer.py")
INDEX, MANIFEST = "model.safetensors.index.json", "stagesafe.json"

pytestmark = pytest.mark.timeout(180)


# -- helpers ------------------------------------------------------------------------------------------------------






def files(url: str, options: dict | None = None) -> set[str]:
    fs, root = resolve(url, options)
    return set(list_files(fs, root))


def age_leftovers(url: str, keep) -> None:
    """Make every local file not in ``keep`` look older than ORPHAN_AGE: a killed writer's, long ago. (A save
    leaves younger ones alone: they may be another writer's commit in progress.)"""
    if "://" in url:
        return  # an object store: the killed uploads left no object behind (see the test)
    when = time.time() - ORPHAN_AGE - 60
    for name in os.listdir(url):
        if name not in keep:
            os.utime(os.path.join(url, name), (when, when))


def small_state_dict(seed: int, n: int = 4, numel: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)}


def writer(url: str, mode: str, options: dict | None = None, *, timeout: float = 60):
    """Run tests/scripts/faulty_writer.py; return (returncode, stdout, stderr)."""
    args = [sys.executable, WRITER, url, mode] + ([json.dumps(options)] if options else [])
    proc = subprocess.run(args, env=sanitized_env(), capture_output=True, text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def writer_error(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("ERROR ")]
    assert lines, f"the writer raised nothing: {stdout!r}"
    return json.loads(lines[-1][len("ERROR ") :])


# -- a writer killed with SIGKILL in the middle of a save -----------------------------------------------------------

KILL_POINTS = ["mid_shard", "shard_written"]


def _location(kind: str, tmp_path, request) -> tuple[str, dict | None]:
    if kind == "local":
        return str(tmp_path / "handoff"), None
    s3 = request.getfixturevalue("s3")
    # 5 MiB parts: each 32 MiB shard goes up as a multipart upload, which the kill leaves uncompleted
    return s3.new_url(), s3.storage_options(default_block_size=5 * 2**20)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,point",
    [("local", p) for p in KILL_POINTS]
    + [("s3", "mid_shard")],
)
def test_a_writer_killed_mid_save_leaves_the_previous_handoff_intact_and_the_next_save_cleans_up(
    kind, point, tmp_path, request
):
    url, options = _location(kind, tmp_path, request)
    old_sd = small_state_dict(1)
    old = save_state_dict(old_sd, url, max_shard_size="8KB", storage_options=options)  # 2 shards
    code, out, err = writer(url, f"kill@{point}", options)
    assert code == -signal.SIGKILL, (code, out, err[-2000:])
    left = files(url, options) - {*old["shards"], INDEX, MANIFEST}
    if kind == "local":
        assert left, "the killed writer left nothing behind: it died before writing"
        if point == "mid_shard":
            assert any(".tmp-" in name for name in left), left
    else:
        assert not left, left  # an upload never completed leaves no object
    # Readers see the previous handoff, whole.
    assert read_manifest(url, storage_options=options) == old
    assert_bitwise_equal(load_state_dict(url, storage_options=options), old_sd)
    assert verify(url, storage_options=options) == old
    state, tensors = index_reader(url, options)  # the index never names the killed save's shards
    assert state == "whole"
    assert_bitwise_equal(tensors, old_sd)
    # A later save removes what the killed writer left, once it is old.
    age_leftovers(url, keep={*old["shards"], INDEX, MANIFEST})
    new_sd = small_state_dict(3)
    new = save_state_dict(new_sd, url, max_shard_size="8KB", storage_options=options, overwrite=True)
    assert files(url, options) == {*new["shards"], INDEX, MANIFEST}
    assert_bitwise_equal(load_state_dict(url, storage_options=options), new_sd)


def index_reader(url: str, options: dict | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """What a loader that follows the Hugging Face index gets: the index's JSON, then every file it names read
    with safetensors. ``("whole", tensors)`` when each named file holds exactly the tensors the index puts
    there; otherwise what went wrong."""
    from safetensors.torch import load

    fs, root = resolve(url, options)
    weight_map = json.loads(fs.cat_file(f"{root}/{INDEX}"))["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for file in set(weight_map.values()):
        try:
            held = load(fs.cat_file(f"{root}/{file}"))
        except Exception as exc:  # noqa: BLE001 - a missing or unreadable file, said as such
            return f"{file}: {exc}", tensors
        if set(held) != {n for n, named in weight_map.items() if named == file}:
            return f"{file} holds other tensors", tensors
        tensors.update(held)
    return "whole", dict(sorted(tensors.items()))


@pytest.mark.slow
@pytest.mark.parametrize("point", ["manifest_written", "index_written"])
def test_a_writer_killed_after_its_commit_leaves_the_new_handoff_an_index_of_a_whole_save_and_the_old_files_are_cleaned(
    tmp_path, point
):
    """Killed between its manifest and its index, the index still names the handoff before, whole: verify says
    so without calling it damage, names the repair, and the repair follows the commit."""
    url = str(tmp_path / "handoff")
    old = save_state_dict(small_state_dict(1), url, max_shard_size="8KB")
    code, out, err = writer(url, f"kill@{point}")
    assert code == -signal.SIGKILL, (code, out, err[-2000:])
    new = read_manifest(url)
    assert set(new["shards"]).isdisjoint(old["shards"])
    assert files(url) == {*old["shards"], *new["shards"], INDEX, MANIFEST}  # the old generation is still there
    assert_bitwise_equal(load_state_dict(url), big_state_dict(seed=2))
    if point == "manifest_written":
        state, tensors = index_reader(url)
        assert state == "whole"
        assert_bitwise_equal(tensors, small_state_dict(1))
        with pytest.raises(HandoffNotReadyError, match="interrupted between its commit and its index.*--fix-index"):
            verify(url)
        assert verify(url, fix_index=True) == new
    state, tensors = index_reader(url)
    assert state == "whole"
    assert_bitwise_equal(tensors, big_state_dict(seed=2))
    assert verify(url) == new
    age_leftovers(url, keep={*new["shards"], INDEX, MANIFEST})
    last = save_state_dict(small_state_dict(3), url, overwrite=True)
    assert files(url) == {*last["shards"], INDEX, MANIFEST}


@pytest.mark.slow
def test_an_index_reader_after_any_kill_of_a_saving_loop_gets_one_whole_committed_save_and_verify_never_says_corrupt(
    tmp_path,
):
    """A writer saves generation after generation over one folder and is killed from outside, 12 times: the
    moment its index or its manifest is renamed into place (as close as a parent can watch), or at a random
    moment. Each time the index names one whole save, one that committed (the one committed now, or the one
    before it, whose files are still there), and verify calls nothing damaged."""
    import random

    from faulty_writer import generation

    url = str(tmp_path / "handoff")
    save_state_dict(generation(0), url, max_shard_size="8KB")
    now, seen = 0, 0  # the committed save and the one the index names
    rng = random.Random(38)
    for round_ in range(12):
        first, before_round, seen_before = now + 1, now, seen
        proc = subprocess.Popen([sys.executable, WRITER, url, f"loop@{first}"], env=sanitized_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "WRITING", proc.stderr.read()[-2000:]
        watched = (INDEX, MANIFEST, None)[round_ % 3]
        if watched is None:
            time.sleep(rng.uniform(0.05, 0.4))
        else:
            _wait_for_a_new(os.path.join(url, watched), proc)
        proc.kill()
        proc.communicate(timeout=30)
        now = int(load_state_dict(url)["layer0.weight"][0])
        state, tensors = index_reader(url)
        assert state == "whole", state
        (seen,) = {int(t[0]) for t in tensors.values()}
        assert_bitwise_equal(tensors, generation(seen))  # one save, whole
        # the committed save, or the one committed just before it
        if now == before_round:
            assert seen in (now, seen_before), (seen, now)
        else:
            assert seen in (now, now - 1 if now > first else before_round), (seen, now)
        try:
            verify(url)
        except HandoffNotReadyError as exc:
            assert "--fix-index" in str(exc) and seen != now, exc


def _wait_for_a_new(path: str, proc: subprocess.Popen) -> None:
    """Return once the file at ``path`` is another file than now (an atomic rename put a new one there)."""
    first = os.stat(path).st_ino
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if os.stat(path).st_ino != first:
                return
        except FileNotFoundError:
            continue


def _partial_shard(folder: str) -> str | None:
    """A shard being written (temporary name, some bytes in it), if there is one now."""
    for entry in os.scandir(folder):
        try:
            if ".tmp-" in entry.name and entry.stat().st_size > 0:
                return entry.name
        except FileNotFoundError:  # renamed into place between the listing and the stat
            continue
    return None


@pytest.mark.slow
def test_a_writer_killed_from_outside_at_any_moment_of_a_large_save(tmp_path):
    """A parent kills the writer (96 MiB in 3 shards) the moment a shard is being written, from outside."""
    url = str(tmp_path / "handoff")
    old_sd = small_state_dict(1)
    old = save_state_dict(old_sd, url, max_shard_size="8KB")
    proc = subprocess.Popen(
        [sys.executable, WRITER, url, "slow"], env=sanitized_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    seen = None
    try:
        deadline = time.monotonic() + 60
        while seen is None and proc.poll() is None and time.monotonic() < deadline:
            seen = _partial_shard(url)
            if seen is None:
                time.sleep(0.001)
        if seen is not None:
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None and seen is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
    assert seen is not None, f"no shard was seen being written (exit code {proc.returncode}): {err[-2000:]!r}"
    assert proc.returncode == -signal.SIGKILL
    assert files(url) - {*old["shards"], INDEX, MANIFEST}  # what it wrote is on disk: a partial shard, or more
    assert read_manifest(url) == old
    assert_bitwise_equal(load_state_dict(url), old_sd)
    assert verify(url) == old
    age_leftovers(url, keep={*old["shards"], INDEX, MANIFEST})
    new_sd = small_state_dict(3)
    new = save_state_dict(new_sd, url, overwrite=True)
    assert files(url) == {*new["shards"], INDEX, MANIFEST}
    assert_bitwise_equal(load_state_dict(url), new_sd)


# -- writes that fail for real ----------------------------------------------------------------------------------------


def _described(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}


def _fault_file_size_limit(base: str):
    """RLIMIT_FSIZE of 1 MiB in the writer process: its 32 MiB shard fails with EFBIG (everywhere)."""
    url = f"{base}/handoff"
    old_sd = small_state_dict(1)
    save_state_dict(old_sd, url, max_shard_size="8KB")
    code, out, err = writer(url, f"fsize={2**20}")
    assert code == 0, err[-2000:]
    return url, old_sd, writer_error(out)


def _fault_no_write_permission(base: str):
    """The handoff folder is not writable for the writer: mode 0555, and the writer runs as ``nobody`` when
    the test runs as root (whom permission bits do not stop)."""
    url = f"{base}/handoff"
    old_sd = small_state_dict(1)
    save_state_dict(old_sd, url, max_shard_size="8KB")
    os.chmod(base, 0o755)
    os.chmod(url, 0o555)
    for name in os.listdir(url):
        os.chmod(os.path.join(url, name), 0o444)
    try:
        code, out, err = writer(url, "nobody")
    finally:
        os.chmod(url, 0o755)
    assert code == 0, err[-2000:]
    return url, old_sd, writer_error(out)


def _fault_read_only_filesystem(base: str, tmpfs):
    """The filesystem holding the handoff is remounted read-only (as ext4 does after an I/O error)."""
    disk = tmpfs("16m")
    url = f"{disk.path}/handoff"
    old_sd = small_state_dict(1)
    save_state_dict(old_sd, url, max_shard_size="8KB")
    disk.remount("ro")  # and stays so: the old handoff must be readable from it as it is
    with pytest.raises(OSError) as info:
        save_state_dict(small_state_dict(2), url, max_shard_size="8KB", overwrite=True)
    return url, old_sd, _described(info.value)


def _fault_disk_full(base: str, tmpfs):
    """A 4 MiB filesystem: the 8 MiB save fails with ENOSPC halfway."""
    disk = tmpfs("4m")
    url = f"{disk.path}/handoff"
    old_sd = small_state_dict(1)
    save_state_dict(old_sd, url, max_shard_size="8KB")
    with pytest.raises(OSError) as info:
        save_state_dict(small_state_dict(2, n=8, numel=2**18), url, max_shard_size="1MB", overwrite=True)
    usage = os.statvfs(disk.path)
    assert usage.f_bfree * usage.f_frsize > 3 * 2**20, "the failed save left its partial shards on the full disk"
    return url, old_sd, _described(info.value)


WRITE_FAULTS = {
    "file_size_limit": _fault_file_size_limit,
    "no_write_permission": _fault_no_write_permission,
    "read_only_filesystem": _fault_read_only_filesystem,
    "disk_full": _fault_disk_full,
}


@pytest.fixture(scope="module")
def fault_results():
    """Outcomes of the subprocess faults, shared by the two tests below (each fault costs a process start)."""
    base = tempfile.mkdtemp(prefix="stagesafe-fault-")  # not under pytest's tmp root: 'nobody' must reach it
    os.chmod(base, 0o755)
    yield base, {}
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def run_fault(tmpfs, fault_results):
    """``run_fault(name)`` -> (url, the state dict of the handoff there before, the save's error described)."""
    base, done = fault_results

    def run(name: str):
        fault = WRITE_FAULTS[name]
        if name in ("read_only_filesystem", "disk_full"):  # in-process and quick; the mount lives for one test
            return fault(tempfile.mkdtemp(dir=base), tmpfs)
        if name not in done:
            done[name] = fault(tempfile.mkdtemp(dir=base))
        return done[name]

    return run


@pytest.mark.parametrize("fault", list(WRITE_FAULTS))
def test_a_write_that_fails_for_real_raises_and_keeps_the_previous_handoff(fault, run_fault):
    url, old_sd, error = run_fault(fault)
    assert "OSError" in error["mro"], error
    assert_bitwise_equal(load_state_dict(url), old_sd)
    manifest = verify(url)
    assert files(url) == {*manifest["shards"], INDEX, MANIFEST}  # the failed save removed what it wrote




@pytest.mark.parametrize(
    "fault",
    WRITE_FAULTS,
)
def test_a_write_that_fails_for_real_names_the_handoff_and_says_the_old_one_is_unchanged(fault, run_fault):
    url, _, error = run_fault(fault)
    assert error["type"] == "StorageTransferError", error
    assert url in error["message"] and ".safetensors" in error["message"], error
    assert "the handoff there before, if any, is unchanged" in error["message"], error


def test_a_handoff_folder_that_cannot_be_created_is_named(tmp_path):
    blocker = tmp_path / "a_regular_file"
    blocker.write_text("not a folder\n")
    url = str(blocker / "handoff")
    with pytest.raises(StorageTransferError) as info:
        save_state_dict(small_state_dict(1), url)
    assert url in str(info.value)


def test_a_handoff_folder_that_cannot_be_created_fails_before_anything_is_written(tmp_path):
    """Its parent is a regular file: a folder that cannot be created, for root too."""
    blocker = tmp_path / "a_regular_file"
    blocker.write_text("not a folder\n")
    with pytest.raises(OSError):
        save_state_dict(small_state_dict(1), str(blocker / "handoff"))
    assert sorted(os.listdir(tmp_path)) == ["a_regular_file"] and blocker.read_text() == "not a folder\n"


@pytest.mark.timeout(60)
def test_an_s3_server_that_stops_mid_upload_fails_the_save_and_keeps_the_previous_handoff(s3):
    """The store-level S3 cases (server gone for good, error answers) are in test_store_s3.py; this one stops
    the server during the multipart upload of a 32 MiB shard."""
    url, opts = s3.new_url(), s3.storage_options(default_block_size=5 * 2**20)
    old_sd = small_state_dict(1)
    save_state_dict(old_sd, url, storage_options=opts)
    s3.stop_on("PUT", r"/model-[^/]*\.safetensors$")  # a part of the multipart upload takes the server down
    with pytest.raises(StorageTransferError, match=r"could not write shard") as info:
        save_state_dict(big_state_dict(seed=2, n=2), url, storage_options=opts, max_shard_size="32MiB",
                        overwrite=True, retry=RetryPolicy(attempts=2, initial_delay=0.05, max_delay=0.1))
    assert url in str(info.value) and "the handoff there before, if any, is unchanged" in str(info.value)
    s3.clear_rules()
    s3.start()
    assert_bitwise_equal(load_state_dict(url, storage_options=opts), old_sd)
    verify(url, storage_options=opts)
    # Not asserted: that the next save leaves no stray object. The failed upload can still complete on its own
    # (see the xfail test below), after the next save has cleaned up. Let that happen now, not in a later test.
    del info
    gc.collect()


@pytest.mark.timeout(60)
def test_a_failed_s3_upload_never_completes_later_over_a_newer_handoff(s3):
    url, opts = s3.new_url(), s3.storage_options(default_block_size=5 * 2**20)
    s3.stop_on("PUT", r"/model-[^/]*\.safetensors$")
    failure = None
    gc.disable()  # the cyclic collector would pick the moment the stale file is closed; the test picks it
    try:
        try:
            save_state_dict(big_state_dict(seed=2, n=2), url, storage_options=opts, max_shard_size="32MiB",
                            overwrite=True, retry=RetryPolicy(attempts=1))
        except StorageTransferError as exc:
            failure = exc  # the caller still holds the error (a notebook, a retry loop, a log handler)
        assert failure is not None
        s3.clear_rules()
        s3.start()
        good = big_state_dict(seed=3, n=2)
        # the same shard name
        manifest = save_state_dict(good, url, storage_options=opts, max_shard_size="32MiB", overwrite=True)
        assert verify(url, storage_options=opts) == manifest
        del failure
    finally:
        gc.enable()
    gc.collect()
    assert verify(url, storage_options=opts) == manifest
    assert_bitwise_equal(load_state_dict(url, storage_options=opts), good)


# -- damaged handoffs: refused by verify and every load, the module untouched --------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 13, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.tensor(5))


def _shards(url: str) -> list[str]:
    return list(read_manifest(url)["shards"])


def _flip_byte(url: str) -> str:
    shard = _shards(url)[1]
    path = os.path.join(url, shard)
    data = bytearray(Path(path).read_bytes())
    data[-3] ^= 0x01
    Path(path).write_bytes(bytes(data))
    return shard


def _truncate(url: str) -> str:
    shard = _shards(url)[1]
    os.truncate(os.path.join(url, shard), os.path.getsize(os.path.join(url, shard)) - 8)
    return shard


def _append(url: str) -> str:
    shard = _shards(url)[1]
    with open(os.path.join(url, shard), "ab") as f:
        f.write(b"\0" * 8)
    return shard


def _delete(url: str) -> str:
    shard = _shards(url)[1]
    os.remove(os.path.join(url, shard))
    return shard


def _swap(url: str) -> str:
    """Two shards trade names (a copy tool that mixed them up); both are wrong, the first one is named."""
    a, b = _shards(url)[:2]
    pa, pb = os.path.join(url, a), os.path.join(url, b)
    os.rename(pa, pa + ".x")
    os.rename(pb, pa)
    os.rename(pa + ".x", pb)
    return a


def _weight_map_moves_a_tensor(url: str) -> str:
    """Manifest and index agree with each other, not with the shards (the manifest resealed with a matching
    checksum, as a forger would: the shard check has to catch it; an unsealed edit is refused earlier)."""
    manifest = read_manifest(url)
    shards = list(manifest["shards"])
    moved = next(n for n, f in manifest["weight_map"].items() if f == shards[1])
    for name in (MANIFEST, INDEX):
        path = os.path.join(url, name)
        doc = json.loads(Path(path).read_text())
        doc["weight_map"][moved] = shards[0]
        if name == MANIFEST:
            doc["checksum"] = manifest_checksum(doc)
        Path(path).write_text(json.dumps(doc))
    return shards[0]


DAMAGES = [_flip_byte, _truncate, _append, _delete, _swap, _weight_map_moves_a_tensor]


@pytest.fixture
def damaged_source(tmp_path):
    def make(damage):
        torch.manual_seed(1)
        url = str(tmp_path / "handoff")
        save_state_dict(Net().state_dict(), url, max_shard_size=200)  # one shard per tensor
        return url, damage(url)

    return make


def _snapshot(module: nn.Module) -> dict:
    state = module.state_dict(keep_vars=True)
    return {name: (id(t), t.data_ptr(), bits(t).clone()) for name, t in state.items()}


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.__name__.strip("_") for d in DAMAGES])
def test_a_damaged_handoff_is_refused_naming_the_shard_and_the_module_is_untouched(damaged_source, damage, capsys):
    url, shard = damaged_source(damage)
    for reader in (verify, load_state_dict):
        with pytest.raises(HandoffCorruptError) as info:
            reader(url)
        assert repr(shard) in str(info.value) and url in str(info.value)
    torch.manual_seed(2)
    target = Net()
    before = _snapshot(target)
    with pytest.raises(HandoffCorruptError) as info:
        restore(target, url)
    assert repr(shard) in str(info.value)
    after = _snapshot(target)
    for name, (ident, ptr, data) in before.items():
        assert after[name][0] == ident and after[name][1] == ptr and torch.equal(after[name][2], data), name
    assert target.head.weight is target.embed.weight
    assert cli_main(["verify", url]) == 1
    assert shard in capsys.readouterr().err


def test_an_index_that_disagrees_with_the_manifest_fails_verify_but_not_restore(tmp_path):
    """By design: the manifest defines the handoff; the index is what Hugging Face loaders read."""
    torch.manual_seed(1)
    source = Net()
    url = str(tmp_path / "handoff")
    manifest = save_state_dict(source.state_dict(), url, max_shard_size=200)
    index_path = Path(url) / INDEX
    index = json.loads(index_path.read_text())
    index["weight_map"]["body.bias"] = next(iter(manifest["shards"]))
    index_path.write_text(json.dumps(index))
    with pytest.raises(HandoffCorruptError, match="in another shard, e.g. 'body.bias'"):
        verify(url)
    target = restore(Net(), url)
    assert torch.equal(target.body.bias, source.body.bias)


def test_a_flipped_bit_in_the_manifest_never_changes_the_weights_silently(tmp_path):
    url = str(tmp_path / "handoff")
    w0, w1 = torch.randn(4), torch.randn(4)
    sd = {"w0": w0, "w1": w1, "w2": w0}  # w2 tied to w0
    save_state_dict(sd, url)
    path = Path(url) / MANIFEST
    data = bytearray(path.read_bytes())
    at = data.index(b'"w2": "w0"') + len(b'"w2": "w')
    data[at] ^= 0x01  # '0' -> '1'
    path.write_bytes(bytes(data))
    try:
        loaded = load_state_dict(url)
    except HandoffCorruptError:
        return
    assert_bitwise_equal(loaded, sd)


# -- bad input that would be committed as a handoff nobody can load -------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("__metadata__", id="safetensors_reserved_name"),
        pytest.param("layer\ud800.weight", id="lone_surrogate"),
    ],
)
def test_a_name_safetensors_cannot_hold_is_refused_before_the_old_handoff_is_replaced(tmp_path, name):
    url = str(tmp_path / "handoff")
    good = small_state_dict(1)
    save_state_dict(good, url)
    with pytest.raises(InvalidArgumentError):
        save_state_dict({name: torch.zeros(3), "other": torch.ones(2)}, url, overwrite=True)
    assert_bitwise_equal(load_state_dict(url), good)


# -- Trainer level: 2 ranks launched from outside (torchrun-style) ---------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability-ranks")
    run_ranks(os.path.join(SCRIPTS, "reliability_ranks.py"), [str(root), str(root / "out")], world_size=2,
              timeout=240, cwd=str(root))
    return [json.loads((root / f"out.rank{r}.json").read_text()) for r in (0, 1)]


def _assert_clean(stage: dict) -> None:
    probe = stage["probe"]
    assert stage["stale"] is None, stage["stale"]
    assert probe["ds_attrs"] == 0 and probe["deepspeed_hooks"] == 0 and probe["user_hooks"] == 1
    assert probe["min_numel"] > 0 and probe["dtypes"] == ["torch.float32"] and probe["devices"] == ["cpu"]


def test_ctrl_c_in_training_step_on_every_rank_leaves_the_last_step_and_the_next_stages_run(ranks):
    (reference,) = ranks[0]["reference"]["stages"]
    _assert_clean(reference)
    for result in ranks:
        interrupted, test, fit = result["interrupt"]["stages"]
        assert interrupted["error"] == "SystemExit: 1"  # Lightning's answer to KeyboardInterrupt: teardown, exit 1
        assert interrupted["global_step"] == 2
        for stage in (interrupted, test, fit):
            _assert_clean(stage)
        assert test["error"] is None and fit["error"] is None
        # two optimizer steps had completed: the module and the handoff hold exactly fit(max_steps=2)
        assert interrupted["probe"]["digest"] == reference["probe"]["digest"] == interrupted["handoff_digest"]
        assert test["probe"]["digest"] == interrupted["probe"]["digest"]
        assert fit["probe"]["digest"] != interrupted["probe"]["digest"]
        assert fit["handoff_digest"] == fit["probe"]["digest"]
    last0, last1 = (result["interrupt"]["stages"][-1]["probe"]["digest"] for result in ranks)
    assert last0 == last1


BAD_RESUMES = [
    "flipped_byte", "truncated_shard", "missing_shard", "weight_map_disagrees", "reshaped_key", "missing_key"
]


@pytest.mark.parametrize("fault", BAD_RESUMES)
def test_resume_from_a_bad_handoff_is_refused_on_every_rank_and_the_module_is_untouched(ranks, fault):
    for rank, result in enumerate(ranks):
        case = result[f"bad_resume:{fault}"]
        refused, test = case["stages"]
        if fault in ("reshaped_key", "missing_key"):
            assert refused["error_type"] == "StateDictMismatchError", refused["error"]
            expected = {"reshaped_key": "reshaped keys: backbone.head.bias",
                        "missing_key": "missing keys: backbone.norm.weight"}[fault]
            assert expected in refused["error"] and "The module was not changed" in refused["error"]
        else:
            assert refused["error_type"] == "HandoffCorruptError", refused["error"]
            assert repr(case["shard"]) in refused["error"], refused["error"]
        assert refused["untouched"], f"rank {rank}: the refused resume changed the module"
        _assert_clean(refused)
        # the same module then resumes from the intact handoff and a stage runs
        assert test["error"] is None, test["error"]
        _assert_clean(test)
        assert test["probe"]["digest"] == result["source_digest"]


def test_resume_from_a_handoff_one_rank_cannot_read_fails_on_every_rank(ranks):
    """A node-local path: rank 0 reads the handoff, rank 1 finds nothing there."""
    refused0 = ranks[0]["bad_resume:one_rank_missing"]["stages"][0]
    refused1 = ranks[1]["bad_resume:one_rank_missing"]["stages"][0]
    assert refused1["error_type"] == "HandoffNotFoundError" and "node-local-of-rank-0" in refused1["error"]
    assert refused0["error_type"] == "DistributedStageError"
    assert "failed on 1 rank(s): rank 1: HandoffNotFoundError" in refused0["error"]
    assert "node-local path is not visible from other nodes" in refused0["error"]
    _assert_clean(refused0)
    _assert_clean(refused1)


def test_resume_that_fails_on_one_rank_changes_no_rank_and_the_next_fit_is_consistent(ranks):
    for result in ranks:
        refused, _ = result["bad_resume:one_rank_missing"]["stages"]
        assert refused["untouched"]
    # fit from the untouched module must equal a plain fit of a fresh module (the 'unwritable' case's second fit)
    plain_fit = ranks[0]["unwritable"]["stages"][1]["probe"]["digest"]
    assert ranks[0]["bad_resume:one_rank_missing"]["stages"][1]["handoff_digest"] == plain_fit


def test_a_handoff_folder_that_cannot_be_created_fails_the_first_stage_on_every_rank(ranks):
    failed0, next0 = ranks[0]["unwritable"]["stages"]
    failed1, next1 = ranks[1]["unwritable"]["stages"]
    assert failed0["error_type"] == "StorageTransferError" and "a_regular_file/handoff" in failed0["error"]
    assert failed1["error_type"] == "DistributedStageError"
    assert "writing to the handoff folder" in failed1["error"] and "failed on rank 0: StorageTransferError" in failed1["error"]
    for failed, later in ((failed0, next0), (failed1, next1)):
        assert failed["untouched"]
        _assert_clean(failed)
        assert later["error"] is None
        _assert_clean(later)
        assert later["handoff_digest"] == later["probe"]["digest"]
    assert next0["probe"]["digest"] == next1["probe"]["digest"]


# -- Trainer level: Ctrl+C in a single-process run (Lightning's own launcher, devices=1) ----------------------------


@pytest.mark.slow
def test_ctrl_c_in_a_single_process_run_leaves_a_clean_module_and_the_next_stages_run(tmp_path):
    out = tmp_path / "out.json"
    run_script(os.path.join(SCRIPTS, "interrupt_fit.py"), [str(tmp_path), str(out)], timeout=150, cwd=str(tmp_path))
    result = json.loads(out.read_text())
    (reference,) = result["reference"]
    interrupted_fit, interrupted_test, test, fit = result["interrupted"]
    assert interrupted_fit["error"] == "SystemExit: 1" and interrupted_fit["global_step"] == 2
    assert interrupted_test["error"] == "SystemExit: 1"
    assert test["error"] is None and fit["error"] is None and reference["error"] is None
    for stage in (reference, interrupted_fit, interrupted_test, test, fit):
        _assert_clean(stage)
        assert stage["handoff_digest"] == stage["probe"]["digest"]
    assert interrupted_fit["probe"]["digest"] == reference["probe"]["digest"]  # fit(max_steps=2), bit for bit
    assert interrupted_test["probe"]["digest"] == test["probe"]["digest"] == interrupted_fit["probe"]["digest"]
    assert fit["probe"]["digest"] != test["probe"]["digest"]


# -- Trainer level: training_step fails on one rank only -------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_fails(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-rank-fails")
    run_ranks(os.path.join(SCRIPTS, "reliability_ranks.py"), [str(root), str(root / "out"), "one_rank_fails"],
              world_size=2, timeout=120, cwd=str(root))
    return [json.loads((root / f"out.rank{r}.json").read_text())["one_rank_fails"] for r in (0, 1)]


def test_a_failure_on_one_rank_surfaces_on_every_rank(one_rank_fails):
    """Rank 1 raises in training_step at step 2; rank 0 waits in a collective until the strategy's ``timeout``
    (5 s here; the default is 30 minutes). Both ranks raise, and both modules are clean and equal. (How long
    that takes is the timeout's business, and no test's: the fixture's own time limit only catches a hang.)"""
    for result in one_rank_fails:
        (failed,) = result["stages"]
        assert failed["error"] is not None
        _assert_clean(failed)
        # the fit's steps could not be consolidated: the module holds the last handoff, the weights it entered with
        assert failed["probe"]["digest"] == result["initial_digest"]
        assert failed["handoff_digest"] == result["initial_digest"]


def test_the_failing_rank_reports_its_own_error(one_rank_fails):
    (failed,) = one_rank_fails[1]["stages"]
    assert "rank 1 fails alone" in failed["error"]
