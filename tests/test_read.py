"""Reading a committed handoff: load_state_dict, HandoffReader and read_manifest, on real files and memory://;
what they refuse (a damaged or forged manifest, links, FIFOs, truncated shards) and what they say when there is
no handoff."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import uuid

import pytest
import safetensors.torch
import torch
from _handoffs import INDEX, MANIFEST, flip_byte, model_dict, three_shards, truncate, two_handoffs, url, write
from _hostile import forge_manifest, opened_files, outside, run_python
from _tensors import assert_bitwise_equal, bits

from stagesafe.errors import HandoffCorruptError, HandoffNotFoundError, InvalidArgumentError, StorageBackendError
from stagesafe.handoff.digest import DEFAULT
from stagesafe.handoff.manifest import digest_of
from stagesafe.handoff.names import tag_for
from stagesafe.handoff.read import is_live_commit, load_state_dict, read_manifest
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.publishing.commit import write_and_replace
from stagesafe.storage.fs import resolve
from stagesafe.publishing.save import save_state_dict
from stagesafe.publishing.verify import verify


def test_a_reader_overtaken_by_a_new_commit_reads_the_new_handoff(url, monkeypatch):
    import stagesafe.handoff.read as read_module

    save_state_dict(model_dict(1, n=4), url, max_shard_size=800)
    stale = read_manifest(url)
    sd2 = model_dict(2, n=4)
    save_state_dict(sd2, url, max_shard_size=800, overwrite=True)  # deletes the shards the stale manifest names
    real, calls = read_module.committed_manifest, []

    def first_stale(folder, **options):  # the reader read the manifest just before the writer committed
        calls.append(folder.root)
        return stale if len(calls) == 1 else real(folder, **options)

    monkeypatch.setattr(read_module, "committed_manifest", first_stale)
    assert_bitwise_equal(load_state_dict(url), sd2)
    assert len(calls) == 2


def test_a_damaged_manifest_is_refused(url):
    three_shards(url)
    write(url, MANIFEST, b'{"format": "stagesafe/1", "shards": ')
    for reader in (verify, load_state_dict, read_manifest):
        with pytest.raises(HandoffCorruptError, match=r"stagesafe\.json is not valid JSON"):
            reader(url)


def test_missing_handoff_says_where_and_asks_about_the_folder(url):
    with pytest.raises(HandoffNotFoundError, match="Is this the right folder") as info:
        load_state_dict(url)
    assert isinstance(info.value, FileNotFoundError)
    assert url.split("://")[-1] in str(info.value)


def test_missing_handoff_hints(tmp_path):
    url = str(tmp_path / "h")
    save_state_dict(model_dict(1), url)
    (tmp_path / "h" / "sub").mkdir()
    with pytest.raises(HandoffNotFoundError, match=r"sub-folder.*pass its parent"):
        read_manifest(f"{url}/sub")
    with pytest.raises(HandoffNotFoundError, match="that is a file"):
        read_manifest(f"{url}/{INDEX}")
    with pytest.raises(HandoffNotFoundError, match=r"sub-folders \['h'\] hold handoffs: pass one of them"):
        read_manifest(str(tmp_path))
    (tmp_path / "h" / MANIFEST).unlink()
    with pytest.raises(HandoffNotFoundError, match=r"no stagesafe\.json, so a write was interrupted"):
        load_state_dict(url)


def test_unknown_protocol_and_missing_backend():
    with pytest.raises(StorageBackendError, match="'nosuchproto'") as info:
        load_state_dict("nosuchproto://bucket/run")
    assert isinstance(info.value, ImportError)
    for url, extra, package in (
        ("s3://b/run", "s3", "s3fs"),
        ("gs://b/run", "gcs", "gcsfs"),
        ("az://c/run", "azure", "adlfs"),
    ):
        if importlib.util.find_spec(package) is not None:
            continue
        with pytest.raises(StorageBackendError, match=rf"install 'stagesafe\[{extra}\]'"):
            save_state_dict({}, url)


def test_a_shard_this_process_wrote_is_mapped_but_a_changed_one_is_hashed_again(tmp_path):
    from stagesafe.handoff import local_shards as _local_shards

    url = str(tmp_path / "handoff")
    sd, shards = three_shards(url)
    path = str(tmp_path / "handoff" / shards[1])
    digest = read_manifest(url)["shards"][shards[1]][DEFAULT]
    assert _local_shards.known(path, DEFAULT, digest)  # the writer hashed these very bytes: no second pass needed
    assert not _local_shards.known(path, "sha256", digest)  # the same hex under another digest's name is not
    assert_bitwise_equal(load_state_dict(url), sd)
    flip_byte(url, shards[1])  # a new file (same name): no longer the one that was hashed
    assert not _local_shards.known(path, DEFAULT, digest)
    with pytest.raises(HandoffCorruptError, match=DEFAULT):
        load_state_dict(url)


def test_verify_false_checks_sizes_and_headers_but_not_hashes(tmp_path):
    url = str(tmp_path / "handoff")
    sd, shards = three_shards(url)
    flip_byte(url, shards[1])
    loaded = load_state_dict(url, verify=False)  # what load_file would give: the changed byte included
    changed = [name for name in sd if not torch.equal(bits(loaded[name]), bits(sd[name]))]
    assert len(changed) == 1
    truncate(url, shards[2])
    with pytest.raises(HandoffCorruptError, match="bytes, the manifest says"):
        load_state_dict(url, verify=False)
    with pytest.raises(InvalidArgumentError, match="verify="):
        load_state_dict(url, verify="yes")


def test_verify_false_reads_a_remote_shard_without_hashing_it():
    url = f"memory:///stagesafe-tests/{uuid.uuid4().hex}"
    sd, shards = three_shards(url)
    flip_byte(url, shards[1])
    loaded = load_state_dict(url, verify=False)
    assert sum(not torch.equal(bits(loaded[name]), bits(sd[name])) for name in sd) == 1
    with pytest.raises(HandoffCorruptError, match=f"has {DEFAULT}"):
        load_state_dict(url)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_loaded_shard_of_several_dtypes_is_saved_by_torch_and_by_safetensors(tmp_path, where):
    """A BatchNorm's int64 ``num_batches_tracked`` beside its fp32 weights: ``torch.save`` refuses views of one
    storage in several dtypes, so each tensor has a storage of its own bytes, as ``load_file``'s have."""
    url = str(tmp_path / "handoff") if where == "local" else f"memory:///stagesafe-tests/{uuid.uuid4().hex}"
    sd = {
        "a": torch.arange(10, dtype=torch.float16),
        "b": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "num_batches_tracked": torch.tensor(7),
        "mask": torch.tensor([True, False, True]),
        "c": torch.randn(3, 5).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }
    save_state_dict(sd, url)
    loaded = load_state_dict(url)
    assert_bitwise_equal(loaded, sd)
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in loaded.values())
    torch.save(loaded, str(tmp_path / "again.pt"))
    assert_bitwise_equal(torch.load(str(tmp_path / "again.pt"), weights_only=True), sd)
    safetensors.torch.save_file(loaded, str(tmp_path / "again.safetensors"))
    again = safetensors.torch.load_file(str(tmp_path / "again.safetensors"))
    assert_bitwise_equal({name: again[name] for name in sd}, sd)


def test_an_old_sha256_handoff_loads_and_verifies(tmp_path, capsys):
    """tests/data/handoff-sha256 was written by stagesafe before the digest was named (commit d9135f2)."""
    from stagesafe.cli import main
    from stagesafe.handoff.read import HandoffReader

    url = str(tmp_path / "old")
    shutil.copytree(os.path.join(os.path.dirname(__file__), "data", "handoff-sha256"), url)
    embed = torch.arange(64, dtype=torch.float32).reshape(16, 4) / 8
    expected = {
        "embed.weight": embed,
        "layer.weight": (torch.arange(32, dtype=torch.float32) - 16).reshape(4, 8).to(torch.bfloat16),
        "layer.steps": torch.tensor([3, 1, 4]),
        "head.weight": embed,
    }
    manifest = read_manifest(url)
    assert manifest["format"] == "stagesafe/1" and digest_of(manifest) == "sha256"
    assert verify(url) == manifest
    loaded = load_state_dict(url)
    assert_bitwise_equal(loaded, expected)
    assert loaded["head.weight"] is loaded["embed.weight"]
    assert_bitwise_equal(dict(HandoffReader(url)), expected)
    assert main(["verify", url]) == 0
    assert "(digest sha256)" in capsys.readouterr().out
    shard = sorted(manifest["shards"])[0]
    flip_byte(url, shard)
    for reader in (verify, load_state_dict):
        with pytest.raises(HandoffCorruptError, match=f"shard '{shard}' has sha256 "):
            reader(url)


def test_a_handoff_naming_a_digest_this_stagesafe_does_not_know_asks_for_an_upgrade(tmp_path):
    url = str(tmp_path / "h")
    save_state_dict(model_dict(1), url)
    forge_manifest(url, lambda m: m.update(digest="xxh4-512"))
    for reader in (verify, load_state_dict, read_manifest):
        with pytest.raises(HandoffCorruptError, match="digest 'xxh4-512' is not one this stagesafe knows.*upgrade"):
            reader(url)


def test_a_manifest_too_large_to_be_one_is_refused_unread(tmp_path):
    url = str(tmp_path / "h")
    save_state_dict({"w": torch.zeros(6)}, url)
    with open(tmp_path / "h" / MANIFEST, "r+b") as f:
        f.truncate(2**40)  # sparse
    for reader in (read_manifest, load_state_dict, verify):
        with pytest.raises(HandoffCorruptError, match=r"stagesafe\.json is 1099511627776 bytes, more than"):
            reader(url)


def test_a_load_shows_a_bar_on_a_terminal_when_asked_and_stays_quiet_otherwise(tmp_path, capsys):
    uri = str(tmp_path / "h")
    save_state_dict({"a": torch.zeros(1000), "b": torch.ones(1000)}, uri, max_shard_size=5000)
    load_state_dict(uri)  # a non-interactive run (pytest's stderr) and a small handoff: nothing
    assert capsys.readouterr().err == ""
    load_state_dict(uri, progress=True)
    err = capsys.readouterr().err
    size = sum(r["size"] for r in read_manifest(uri)["shards"].values())
    assert f"loading {uri}" in err and f"{size / 1000:.2f}k" in err  # the handoff's bytes, in decimal units


def test_a_shard_that_links_outside_the_folder_is_refused_unopened(tmp_path):
    h, other, shard = two_handoffs(tmp_path)
    (h / shard).unlink()
    (h / shard).symlink_to(other / shard)  # the very bytes the manifest hashes
    for reader in (verify, load_state_dict, lambda u: load_state_dict(u, verify=False)):
        refused = pytest.raises(HandoffCorruptError, match="symbolic link to .*outside the folder")
        with opened_files() as opened, refused:
            reader(str(h))
        assert not outside(opened, str(h))
    (h / shard).unlink()
    (h / shard).symlink_to(shard + ".copy")  # a link inside the folder is fine
    os.link(other / shard, h / (shard + ".copy"))
    assert torch.equal(load_state_dict(str(h))["w"], torch.arange(6.0))


_READERS = """
import json, sys, torch
from torch import nn
from stagesafe import load_state_dict, read_manifest, restore, verify
from stagesafe.cli import main
from stagesafe.handoff.read import HandoffReader

url = sys.argv[1] if len(sys.argv) > 1 else {url!r}
readers = {{
    "load_state_dict": lambda: load_state_dict(url),
    "load_state_dict(verify=False)": lambda: load_state_dict(url, verify=False),
    "verify": lambda: verify(url),
    "restore": lambda: restore(nn.Linear(3, 2), url),
    "HandoffReader": lambda: dict(HandoffReader(url)),
    "cli verify": lambda: main(["verify", url]),
    "cli inspect": lambda: main(["inspect", url]),
}}
out = {{}}
for name, read in readers.items():
    try:
        out[name] = ["returned", repr(read())[:60]]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]
print("RESULT " + json.dumps(out))
"""


def _read_in_a_process(url: str) -> dict:
    result = run_python(_READERS.format(url=url), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.parametrize("what", ["shard", "link_to_a_fifo", "manifest", "index", "index_entry"])
def test_a_fifo_in_a_handoff_is_refused_by_every_reader_without_blocking(tmp_path, what):
    """Opening a FIFO for reading blocks until a writer comes. Each reader runs in a process of its own with a
    timeout, so that a reader that blocks fails this test instead of hanging it."""
    url = str(tmp_path / "h")
    (shard,) = save_state_dict(nn_linear_state(), url)["shards"]
    h = tmp_path / "h"
    if what in ("shard", "manifest", "index"):
        name = {"shard": shard, "manifest": MANIFEST, "index": INDEX}[what]
        (h / name).unlink()
        os.mkfifo(h / name)
    elif what == "link_to_a_fifo":
        (h / shard).unlink()
        os.mkfifo(h / "pipe")
        (h / shard).symlink_to(h / "pipe")
    else:
        os.mkfifo(h / "model-00001-of-00002.safetensors")
        index = json.loads((h / INDEX).read_text())
        index["weight_map"] = {"weight": "model-00001-of-00002.safetensors", "bias": "model-00001-of-00002.safetensors"}
        (h / INDEX).write_text(json.dumps(index))
    outcomes = _read_in_a_process(url)
    readers_of = {  # which readers open the file: inspect reads the manifest only, loads never read the index
        "manifest": set(outcomes),
        "shard": set(outcomes) - {"cli inspect"},
        "link_to_a_fifo": set(outcomes) - {"cli inspect"},
        "index": {"verify", "cli verify"},
        "index_entry": {"verify", "cli verify"},
    }[what]
    for reader, (kind, message) in outcomes.items():
        if reader not in readers_of:
            assert (kind, message[:1]) in (("returned", "{"), ("returned", "0"), ("returned", "L")), (reader, message)
        elif reader.startswith("cli"):
            assert (kind, message) == ("returned", "1"), (reader, message)  # exit 1: the handoff failed its checks
        else:
            assert kind == "HandoffCorruptError", (reader, kind, message)
            assert "FIFO" in message, (reader, message)


def nn_linear_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(2, 3, generator=g), "bias": torch.randn(2, generator=g)}


_TRUNCATE_UNDER = """
import os, sys, torch, glob
from safetensors.torch import load_file
import stagesafe
uri, who, when = sys.argv[1], sys.argv[2], sys.argv[3]
shard = sorted(glob.glob(os.path.join(uri, "*.safetensors")))[0]
if when == "before":
    os.truncate(shard, os.path.getsize(shard) // 2)
loaded = load_file(shard) if who == "load_file" else stagesafe.load_state_dict(uri)
if when == "after":  # a tool truncates the file in place while the tensors are in use
    os.truncate(shard, 4096)
print("SUM", float(sum(t.float().sum() for t in loaded.values())), flush=True)
"""


@pytest.mark.parametrize("who", ["stagesafe", "load_file"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_shard_truncated_under_the_mapping_is_refused_before_and_fails_as_load_file_after(tmp_path, who, when):
    """The fast path maps local shards, as load_file does. Sizes are checked before a byte is read, so a file cut
    before the load is refused; one cut in place while its tensors are in use faults on the missing pages
    (SIGBUS), as with load_file: stagesafe's own writers never truncate in place (docs/reliability.md, Limits)."""
    uri = str(tmp_path / "h")
    save_state_dict({"w": torch.ones(1 << 20)}, uri)  # 4 MB, one shard
    result = run_python(_TRUNCATE_UNDER, uri, who, when)
    if when == "after":
        assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr[-500:])
    elif who == "stagesafe":
        assert result.returncode == 1 and "HandoffCorruptError" in result.stderr, result.stderr[-500:]
        assert "SUM" not in result.stdout
    else:
        assert result.returncode != 0  # load_file refuses a cut file too ("incomplete metadata" or similar)


def _mapped_file(address: int) -> str | None:
    """The file that the mapping holding ``address`` maps (from /proc/self/maps), or None for anonymous memory."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(part, 16) for part in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else None
    return None


@pytest.mark.parametrize("verify_bytes", [True, False])
def test_a_local_load_gives_views_of_the_shards_mapping_not_copies(tmp_path, verify_bytes):
    """As ``load_file``: no copy into memory of our own, checked or not (the checked load hashes through the
    mapping: one pass over the bytes beside the hash)."""
    target = str(tmp_path / "handoff")
    sd, shards = three_shards(target)
    loaded = load_state_dict(target, verify=verify_bytes)
    assert_bitwise_equal(loaded, sd)
    files = {_mapped_file(t.data_ptr()) for t in loaded.values() if t.numel()}
    assert files and files <= {os.path.join(target, name) for name in shards}, files


def test_a_write_asks_whether_its_commit_is_the_live_one(tmp_path):
    """What an interrupted write asks: its key's commit is live until another write's replaces it."""
    uri = str(tmp_path / "h")
    with pytest.raises(HandoffNotFoundError):
        is_live_commit(uri, "write-1")
    fs, root = resolve(uri)
    for key in ("write-1", "write-2"):
        write_and_replace(fs, root, plan_handoff({"w": torch.ones(3)}, tag=tag_for(key)), metadata=None)
    assert is_live_commit(uri, "write-2") and not is_live_commit(uri, "write-1")
