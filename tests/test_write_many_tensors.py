"""The handoff write's per-tensor short cuts (issue 39, many small tensors): each writes exactly the bytes the
general path writes, and each is taken where it should be."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from _tensors import assert_bitwise_equal

import stagesafe.handoff.read as read_module
from stagesafe.errors import HandoffCorruptError, InvalidArgumentError
from stagesafe.handoff import codec, shards
from stagesafe.handoff.codec import check_tensor, encode_header
from stagesafe.publishing.commit import readable_json
from stagesafe.handoff.names import INDEX_NAME, MANIFEST_NAME
from stagesafe.handoff.plan import dtype_name
from stagesafe.handoff.read import load_state_dict, read_manifest
from stagesafe.publishing.save import save_state_dict
from stagesafe.handoff.tensor_plan import plan_handoff


def _mixed() -> dict[str, torch.Tensor]:
    """Tiny tensors of every kind a state dict holds: dtypes, 0-d, empty, non-contiguous, offset views, views
    sharing one storage (overlapping too), and a large one."""
    torch.manual_seed(0)
    base = torch.randn(8, 6)
    out: dict[str, torch.Tensor] = {f"tiny.{i}": torch.randn(16) for i in range(300)}
    out.update(
        {
            "bf16": torch.randn(5).to(torch.bfloat16),
            "int8": torch.arange(-7, 7, dtype=torch.int8),
            "bool": torch.tensor([True, False, True]),
            "f64": torch.randn(3, dtype=torch.float64),
            "u16": torch.arange(9, dtype=torch.int32).to(torch.uint16),
            "zero_d": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "transposed": base.t(),
            "row": base[3],
            "column": base[:, 2],
            "overlap_a": base.view(-1)[5:20],
            "overlap_b": base.view(-1)[10:30],
            "one_of_wide": base[1:2, 4:5],
            "complex": torch.randn(3, dtype=torch.complex64),
            "fp8": torch.randn(6).to(torch.float8_e4m3fn),
            "large": torch.randn(300_000),  # over tensor_bytes.SMALL: written as it is, between runs
            "after_large": torch.randn(7),
        }
    )
    return out


def _reference_bytes(specs, tensors) -> bytes:
    """A shard as the format defines it: the header, then each tensor's values, row-major, in plan order."""
    header, _ = encode_header(specs)
    body = b"".join(
        tensors[name].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for name in specs
    )
    return header + body


def test_many_small_tensors_are_one_chunk_and_exactly_the_formats_bytes():
    """300 tiny tensors and every odd kind beside them: the bytes are exactly the format's, and the writer hands
    the file (and its hash) a few chunks, not one per tensor."""
    tensors = _mixed()
    specs = {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for name, t in tensors.items()}
    header, size = encode_header(specs)
    chunks = list(shards.safetensors_chunks(header, specs, tensors))
    assert b"".join(bytes(c) for c in chunks) == _reference_bytes(specs, tensors)
    # The header, the runs between the tensors written apart (non-contiguous, "large"), those: not one per tensor.
    assert len(chunks) == 8 and len(tensors) > 300
    assert sum(len(c) for c in chunks) == size


def test_a_saved_handoff_of_mixed_tiny_tensors_loads_bitwise_in_safetensors_and_stagesafe(tmp_path):
    tensors = _mixed()
    save_state_dict(tensors, str(tmp_path / "h"))
    manifest = read_manifest(str(tmp_path / "h"))
    (shard,) = manifest["shards"]
    expected = {name: t.contiguous() for name, t in tensors.items()}
    assert_bitwise_equal(safetensors.torch.load_file(str(tmp_path / "h" / shard)), expected)
    assert_bitwise_equal(load_state_dict(str(tmp_path / "h")), expected)
    plan = plan_handoff(tensors)
    assert (tmp_path / "h" / shard).read_bytes() == _reference_bytes(plan.shard_specs(next(iter(plan.shards))), tensors)


def test_a_lazy_mapping_gives_up_each_small_tensor_before_the_next_is_read(tmp_path):
    """Small tensors are copied as they are added to a run, not held until it is written."""
    import weakref

    alive: list[weakref.ref] = []
    counts: list[int] = []

    class Lazy(dict):
        def __getitem__(self, name):
            counts.append(sum(r() is not None for r in alive))
            t = torch.full((16,), float(len(counts)))
            alive.append(weakref.ref(t))
            return t

    names = [f"t{i}" for i in range(50)]
    specs = {name: {"dtype": "float32", "shape": [16]} for name in names}
    header, _ = encode_header(specs)
    data = b"".join(bytes(c) for c in shards.safetensors_chunks(header, specs, Lazy.fromkeys(names)))
    assert counts == [0] * 50
    assert data[len(header):] == torch.arange(1, 51, dtype=torch.float32).repeat_interleave(16).numpy().tobytes()


@pytest.mark.parametrize(
    "name, dtype, shape",
    [
        ("a", "float32", [16]),
        ("a", "bfloat16", (3, 0, 2**62)),
        ("b", "float8_e4m3fn", []),
        ("ünï", "int64", [2, 3]),
        ("a", "float32", [2**62, 0]),  # past 2**64 in bytes, then 0: valid, by the full checks
    ],
)
def test_the_quick_check_accepts_only_what_the_full_check_accepts(name, dtype, shape):
    check_tensor(name, dtype, shape)
    if codec.plainly_valid(name, dtype, shape):
        return
    assert shape == [2**62, 0]  # left to the full checks, which accept it


@pytest.mark.parametrize(
    "name, dtype, shape",
    [
        ("", "float32", [1]),
        ("__metadata__", "float32", [1]),
        ("\ud800", "float32", [1]),
        (3, "float32", [1]),
        ("a", "float4", [1]),
        ("a", ["float32"], [1]),
        ("a", "float32", [True]),
        ("a", "float32", [1.0]),
        ("a", "float32", [-1]),
        ("a", "float32", [2**63]),
        ("a", "float32", [2**62, 4]),
        ("a", "float32", "16"),
        ("a", "float32", range(3)),
    ],
)
def test_the_quick_check_refuses_what_the_full_check_refuses_and_leaves_it_the_message(name, dtype, shape):
    assert not codec.plainly_valid(name, dtype, shape)
    if not (isinstance(shape, range)):  # a range is a valid Sequence of ints: the full checks accept it
        with pytest.raises(InvalidArgumentError):
            check_tensor(name, dtype, shape)


def _readable_json_before(value, *, sort_keys=False, depth=0) -> str:
    """readable_json as it was written before its rows were written directly."""
    one_line = json.JSONEncoder(sort_keys=sort_keys, separators=(", ", ": "))
    if depth >= 2 or not isinstance(value, dict) or not value:
        return one_line.encode(value)
    pad = "  " * (depth + 1)
    items = sorted(value.items()) if sort_keys else value.items()
    body = ",\n".join(
        f"{pad}{json.dumps(key)}: {_readable_json_before(item, sort_keys=sort_keys, depth=depth + 1)}"
        for key, item in items
    )
    return "{\n" + body + "\n" + "  " * depth + "}"


@pytest.mark.parametrize("sort_keys", [False, True])
def test_the_rows_written_directly_are_the_encoders_bytes(sort_keys):
    odd = ['a"b', "tab\there", "é漢字", "\x01ctrl", "back\\slash", "a, b: c"]
    manifest = {
        "format": "stagesafe/2",
        "tensors": {
            **{name: {"dtype": "float32", "shape": [2, 3]} for name in odd},
            "empty": {"dtype": "bfloat16", "shape": []},
            "huge": {"dtype": "int8", "shape": [2**63 - 1]},
            "shape_first": {"shape": [1], "dtype": "float32"},
            "bool_dim": {"dtype": "float32", "shape": [True]},
            "extra": {"dtype": "float32", "shape": [1], "x": 1},
        },
        "weight_map": {name: f"shard-{name}" for name in odd},
        "metadata": {"nested": {"a": [1, 2.5, None]}},
        "total_size": 7,
    }
    assert readable_json(manifest, sort_keys=sort_keys) == _readable_json_before(manifest, sort_keys=sort_keys)
    assert json.loads(readable_json(manifest, sort_keys=sort_keys)) == manifest


def _counting_validations(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = read_module.validate_manifest

    def counted(manifest, *, source):
        seen.append(source)
        return real(manifest, source=source)

    monkeypatch.setattr(read_module, "validate_manifest", counted)
    return seen


def test_a_manifest_this_process_wrote_is_not_validated_again_when_read(tmp_path, monkeypatch):
    """The save's own read-backs (the index following the manifest, cleanup, the next save's look at the handoff
    it replaces) and a later load take bytes already found valid: none validates them again."""
    uri = str(tmp_path / "h")
    values = {f"t{i}": torch.randn(4) for i in range(20)}
    seen = _counting_validations(monkeypatch)
    save_state_dict(values, uri)
    save_state_dict(values, uri, overwrite=True)
    assert_bitwise_equal(load_state_dict(uri), values)
    assert seen == []
    index = json.loads((tmp_path / "h" / INDEX_NAME).read_text())
    assert index["weight_map"] == read_manifest(uri)["weight_map"]


def test_changed_manifest_bytes_are_validated_and_refused(tmp_path, monkeypatch):
    uri = str(tmp_path / "h")
    save_state_dict({"w": torch.randn(4)}, uri)
    path = tmp_path / "h" / MANIFEST_NAME
    text = path.read_text()
    seen = _counting_validations(monkeypatch)
    path.write_text(text.replace('"total_size": 16', '"total_size": 17'))
    with pytest.raises(HandoffCorruptError, match="checksum"):
        read_manifest(uri)
    path.write_text(text + " ")  # the same manifest in other bytes: validated once, then known
    read_manifest(uri)
    read_manifest(uri)
    assert len(seen) == 2
