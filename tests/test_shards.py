"""Writing shard files: a tensor given as pieces, and the parallel writer's clean-up when a shard fails."""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Mapping

import pytest
import safetensors.torch
import torch
from _tensors import assert_bitwise_equal

from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff.digest import DEFAULT, hash_buffer
from stagesafe.storage.fs import list_files, resolve
from stagesafe.handoff.plan import plan_specs
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.handoff.shards import Pieces, write_shard, write_shards


def test_pieces_are_written_as_the_tensor_they_join_into(tmp_path):
    """A value given as pieces (views of mapped files, in the CLI) is stored as the one tensor they join into,
    each piece handed back once written."""
    full = torch.randn(6, 5)
    flat = full.view(-1)
    parts = (flat[:7], flat[7:20], flat[20:])
    used: list[torch.Tensor] = []
    bias = torch.randn(5)
    values = {"w": Pieces(torch.float32, (6, 5), parts, done=used.append), "b": bias}
    specs = {"w": {"dtype": "float32", "shape": [6, 5]}, "b": {"dtype": "float32", "shape": [5]}}
    fs, root = resolve(str(tmp_path))
    plan = plan_handoff({"w": full, "b": bias})
    (name,) = plan.shards
    record = write_shard(fs, root, name, values, specs=specs)
    loaded = safetensors.torch.load_file(str(tmp_path / name))
    assert_bitwise_equal(loaded, {"w": full, "b": bias})
    assert [id(p) for p in used] == [id(p) for p in parts]
    assert record.digest == DEFAULT
    assert record.hexdigest == hash_buffer(DEFAULT, (tmp_path / name).read_bytes())

    wrong = {"w": Pieces(torch.float32, (5, 6), parts), "b": bias}
    with pytest.raises(InvalidArgumentError, match=r"'w' is float32\[5, 6\] but was planned as float32\[6, 5\]"):
        write_shard(fs, root, name, wrong, specs=specs)


def test_a_one_element_slice_of_a_wider_tensor_is_written(tmp_path):
    """A bias of one element cut from a rank's flat partition (its stride that of the partition's rows: torch
    calls it contiguous) is written as its value: a plain user's 2-rank fit had its handoff fail on it."""
    partitions = torch.arange(162, dtype=torch.float32).view(2, 81)
    bias = partitions[0:1, 80]
    assert bias.is_contiguous() and bias.stride() == (81,)
    values = {"b": bias, "w": partitions[1, :16].view(1, 16)}
    fs, root = resolve(str(tmp_path))
    plan = plan_handoff(values)
    (name,) = plan.shards
    specs = {"b": {"dtype": "float32", "shape": [1]}, "w": {"dtype": "float32", "shape": [1, 16]}}
    write_shard(fs, root, name, values, specs=specs)
    loaded = safetensors.torch.load_file(str(tmp_path / name))
    assert loaded["b"].tolist() == [80.0] and torch.equal(loaded["w"], torch.arange(81, 97.0).view(1, 16))


class _Lazy(Mapping):
    """A state dict whose tensors are made when asked for (as consolidate reads a checkpoint): it records how
    many of those it made are still alive when the next is asked for, and fails on ``bad``."""

    def __init__(self, sizes, bad=None):
        self.sizes, self.bad = sizes, bad
        self.made: list[weakref.ref] = []
        self.alive_when_asked: list[int] = []

    def __getitem__(self, name):
        self.alive_when_asked.append(sum(ref() is not None for ref in self.made))
        if name == self.bad:
            raise RuntimeError("device lost while reading " + name)
        tensor = torch.full((self.sizes[name],), float(len(self.made)))
        self.made.append(weakref.ref(tensor))
        return tensor

    def __iter__(self):
        return iter(self.sizes)

    def __len__(self):
        return len(self.sizes)


def _lazy_plan(lazy):
    specs = {name: {"dtype": "float32", "shape": [n]} for name, n in lazy.sizes.items()}
    return plan_specs(specs, {}, max_shard_size=1000, state_dict=lazy)


def test_write_shards_takes_each_tensor_once_as_its_bytes_are_due(tmp_path):
    """The one parallel writer reads a lazy state dict one tensor at a time, the previous one dropped, in the
    plan's order: consolidate's memory stays at one tensor per shard in flight."""
    lazy = _Lazy({f"t{i}": 100 for i in range(6)})  # 400 bytes each: three shards of two
    plan = _lazy_plan(lazy)
    fs, root = resolve(str(tmp_path / "h"))
    records = write_shards(fs, root, plan, workers=1)
    assert list(records) == list(plan.shards) and len(records) == 3
    assert lazy.alive_when_asked == [0] * 6
    for i, (name, file) in enumerate(plan.weight_map.items()):
        loaded = safetensors.torch.load_file(str(tmp_path / "h" / file))
        assert torch.equal(loaded[name], torch.full((100,), float(i)))


@pytest.mark.parametrize("where", ["path", "memory"])
def test_a_failed_write_removes_every_shard_it_started_and_the_folder_it_created(tmp_path, where):
    """A tensor that cannot be read halfway through a shard: nothing of the write is left, not the shard
    written before it nor the part of the failing one (memory:// publishes a file as it is opened), and the
    folder goes too when the caller created it (remove_root); a folder that was there stays."""
    url = str(tmp_path / "h") if where == "path" else f"memory:///stagesafe-tests/{uuid.uuid4().hex}"
    fs, root = resolve(url)
    lazy = _Lazy({f"t{i}": 100 for i in range(6)}, bad="t3")  # t3: the second tensor of the second shard
    with pytest.raises(RuntimeError, match="device lost while reading t3"):
        write_shards(fs, root, _lazy_plan(lazy), workers=1, remove_root=True)
    assert not fs.exists(root)

    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/notes.txt", b"mine")
    with pytest.raises(RuntimeError, match="device lost"):
        write_shards(fs, root, _lazy_plan(_Lazy({f"t{i}": 100 for i in range(6)}, bad="t3")), workers=2)
    assert list_files(fs, root) == ["notes.txt"]
    fs.rm(root, recursive=True)
