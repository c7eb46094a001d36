"""handoff/local_shards.py: which local files this process already knows the digest of (the very file, unchanged),
shard files mapped copy-on-write and hashed through the mapping, and their tensors as views of it, on real files.

(A shard that a save wrote is known to its load, and one changed since is hashed again: tests/test_read.py.)
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import safetensors.torch
import torch
from _hostile import safetensors_bytes
from _tensors import assert_bitwise_equal

from stagesafe.errors import HandoffCorruptError
from stagesafe.handoff.digest import DEFAULT, SHA256, hash_buffer
from stagesafe.handoff.local_shards import known, map_file, map_hashed, remember, tensors_in

HEX = hashlib.sha256(b"weights").hexdigest()


@pytest.fixture
def shard(tmp_path) -> str:
    path = str(tmp_path / "model.safetensors")
    with open(path, "wb") as f:
        f.write(b"weights")
    return path


# -- files whose digest this process knows ---------------------------------------------------------------------------


def test_a_remembered_file_is_known_under_its_digest_only(shard, tmp_path):
    assert not known(shard, SHA256, HEX)  # nothing remembered yet
    remember(shard, SHA256, HEX)
    assert known(shard, SHA256, HEX)
    assert not known(shard, SHA256, "0" * 64) and not known(shard, DEFAULT, HEX)
    assert not known(str(tmp_path / "other"), SHA256, HEX)


@pytest.mark.parametrize("change", ["touched", "copied_over", "deleted"])
def test_a_known_file_is_unknown_once_changed_even_to_the_same_bytes(shard, change):
    remember(shard, SHA256, HEX)
    if change == "touched":  # same bytes, same inode, another modification time
        st = os.stat(shard)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    elif change == "copied_over":  # same bytes and times, another inode: a new file under the name
        shutil.copy2(shard, shard + ".copy")
        os.replace(shard + ".copy", shard)
    else:
        os.remove(shard)
    assert not known(shard, SHA256, HEX)


def test_a_file_that_cannot_be_read_is_not_remembered(tmp_path):
    path = str(tmp_path / "never-written")
    remember(path, SHA256, HEX)
    with open(path, "wb") as f:
        f.write(b"weights")
    assert not known(path, SHA256, HEX)


def test_a_file_asked_about_through_its_open_handle_is_the_file_in_hand(shard):
    with open(shard, "rb") as f:
        remember(shard, SHA256, HEX, f=f)
        assert known(shard, SHA256, HEX, f=f) and known(shard, SHA256, HEX)
    with open(shard + ".next", "wb") as new:
        new.write(b"weights")
    os.replace(shard + ".next", shard)  # a writer's commit: the same bytes in a new file
    with open(shard, "rb") as g:
        assert not known(shard, SHA256, HEX, f=g)


# -- mapping and hashing ---------------------------------------------------------------------------------------------


def test_a_mapping_holds_the_first_bytes_and_writing_it_leaves_the_file_alone(shard):
    with open(shard, "rb") as f:
        mapped = map_file(f, 4)
        empty = map_file(f, 0)
    assert mapped.dtype == torch.uint8 and bytes(mapped.numpy()) == b"weig"  # still readable: the file is closed
    mapped[0] = ord("W")  # copy-on-write: this process's page only
    assert bytes(mapped.numpy()) == b"Weig"
    with open(shard, "rb") as f:
        assert f.read() == b"weights"
    assert empty.numel() == 0 and empty.dtype == torch.uint8


@pytest.mark.parametrize("digest", [SHA256, DEFAULT])
def test_the_digest_is_of_the_mapped_bytes(tmp_path, digest):
    data = os.urandom(3 * 2**20 + 5)
    path = tmp_path / "shard"
    path.write_bytes(data + b"beyond the size given")
    with open(path, "rb") as f:
        buffer, found = map_hashed(f, len(data), digest)
    assert bytes(buffer.numpy()) == data
    assert found == hash_buffer(digest, data)
    if digest == SHA256:
        assert found == hashlib.sha256(data).hexdigest()


# -- tensors of a mapped file ----------------------------------------------------------------------------------------


def _mapped(tmp_path, data: bytes) -> torch.Tensor:
    path = tmp_path / "shard.safetensors"
    path.write_bytes(data)
    with open(path, "rb") as f:
        return map_file(f, len(data))


def _inside(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel() or tensor.numel() == 0


def test_tensors_are_views_of_the_mapping_as_safetensors_reads_them(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "b": torch.randn(5, generator=g, dtype=torch.float64),
        "step": torch.tensor(7),
        "none": torch.zeros(0, 2),
        "flag": torch.tensor([True, False]),
    }
    data = safetensors.torch.save(state)
    buffer = _mapped(tmp_path, data)
    tensors = tensors_in(buffer, source="the shard")
    expected = safetensors.torch.load(data)
    assert_bitwise_equal(dict(sorted(tensors.items())), dict(sorted(expected.items())))
    assert all(_inside(t, buffer) for t in tensors.values())  # no copy
    buffer[-1] ^= 0xFF  # the last byte is the last tensor's: a view sees it
    last = max(tensors, key=lambda name: tensors[name].data_ptr() + tensors[name].nbytes)
    assert not torch.equal(tensors[last], expected[last])


def test_a_tensor_misaligned_for_its_dtype_is_a_copy_with_the_right_values(tmp_path):
    """safetensors packs tensors back to back: a float32 after one byte starts at an odd offset."""
    header = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}
    values = torch.tensor([1.5, -2.25])
    buffer = _mapped(tmp_path, safetensors_bytes(header, b"\x07" + values.numpy().tobytes()))
    tensors = tensors_in(buffer, source="the shard")
    assert tensors["a"].tolist() == [7] and _inside(tensors["a"], buffer)
    assert_bitwise_equal({"b": tensors["b"]}, {"b": values})
    assert not _inside(tensors["b"], buffer)


def test_a_damaged_file_is_refused_naming_it(tmp_path):
    data = safetensors.torch.save({"w": torch.ones(4)})
    with pytest.raises(HandoffCorruptError, match="model-00001-of-00001.safetensors"):
        tensors_in(_mapped(tmp_path, data[:-3]), source="model-00001-of-00001.safetensors")


def _vm_flags(address: int) -> list[str]:
    """The kernel's flags of the mapping that holds ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc/self/smaps")
def test_a_shard_is_mapped_for_reading_in_order(tmp_path):
    """From the disk, a mapping read without this advice (small read-around per fault) took 0.95-1.49 s for 1 GB
    where ``load_file`` took 0.61-0.89 s; with it, 0.59-0.63 s (docs/performance.md)."""
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.arange(40000.0)}, str(path))
    with open(path, "rb") as f:
        for buffer in (map_file(f, os.path.getsize(path)), map_hashed(f, os.path.getsize(path), DEFAULT)[0]):
            assert "sr" in _vm_flags(buffer.data_ptr())  # VM_SEQ_READ: madvise(MADV_SEQUENTIAL)
