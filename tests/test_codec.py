"""The safetensors header codec: it reads what safetensors reads, refuses what safetensors refuses (and the few
things it documents refusing beside), and writes only headers it reads back. Plain bytes, no files."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
from _pure import PURE, imports_of

import stagesafe.handoff.codec
from stagesafe.errors import HandoffCorruptError, InvalidArgumentError
from stagesafe.handoff.codec import MAX_HEADER, check_tensor, encode_header, header_length, parse_header


def test_it_imports_neither_torch_nor_fsspec():
    assert imports_of(stagesafe.handoff.codec) <= PURE


def blob(header: object = None, data: bytes = b"", *, raw: bytes | None = None, length: int | None = None) -> bytes:
    """A safetensors file: 8-byte length, header (``raw`` bytes, or ``header`` as JSON), padded to 8, data."""
    text = raw if raw is not None else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def ours(data: bytes):
    return parse_header(data, len(data), source="'x': shard 'f'")


def safetensors_reads(data: bytes) -> bool:
    try:
        safetensors.torch.load(data)
    except Exception:  # noqa: BLE001 - SafetensorError, or KeyError for a dtype its torch table lacks
        return False
    return True


F32x2 = entry("F32", [2], 0, 8)

ACCEPTED = {
    "one tensor": blob({"a": F32x2}, b"\0" * 8),
    "metadata": blob({"__metadata__": {"format": "pt"}, "a": F32x2}, b"\0" * 8),
    "metadata null": blob({"__metadata__": None, "a": F32x2}, b"\0" * 8),
    "no tensors": blob({}),
    "zero-size tensors share an offset": blob({"z": entry("F32", [0, 3], 0, 0), "a": F32x2}, b"\0" * 8),
    "header order is not offset order": blob({"b": entry("F32", [2], 8, 16), "a": F32x2}, b"\0" * 16),
    "header not padded": blob(None, b"\0" * 8, raw=b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
    "leading space": blob(None, b"\0" * 8, raw=b' {"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
    "empty name": blob({"": F32x2}, b"\0" * 8),
    "unicode name": blob({"ü.權重": F32x2}, b"\0" * 8),
    "0-d": blob({"a": entry("I64", [], 0, 8)}, b"\0" * 8),
}

# Refused by safetensors as well (the test checks it), then the message stagesafe gives.
REFUSED = {
    "overlapping offsets": (blob({"a": F32x2, "b": F32x2}, b"\0" * 8), "gap or overlap"),
    "a gap": (blob({"a": F32x2, "b": entry("F32", [2], 12, 20)}, b"\0" * 20), "gap or overlap"),
    "offsets past the end": (blob({"a": entry("F32", [2], 0, 8)}, b"\0" * 4), "cover 8 bytes"),
    "bytes after the data": (blob({"a": F32x2}, b"\0" * 12), "cover 8 bytes"),
    "end before begin": (blob({"a": entry("F32", [0], 8, 0)}, b""), "gap or overlap"),
    "dtype disagrees with byte count": (blob({"a": entry("F32", [3], 0, 8)}, b"\0" * 8), "12 bytes"),
    "2**40 elements": (blob({"a": entry("F32", [2**40], 0, 8)}, b"\0" * 8), "bytes, but its data_offsets"),
    "shape overflows": (blob({"a": entry("F32", [2**40, 2**40], 0, 8)}, b"\0" * 8), "overflows 2**64"),
    "a dimension over int64, beside a 0": (blob({"a": entry("F32", [0, 2**63 + 5], 0, 0)}), "torch's sizes"),
    "unknown dtype": (blob({"a": entry("F128", [2], 0, 8)}, b"\0" * 8), "dtype 'F128'"),
    "lower-case dtype": (blob({"a": entry("f32", [2], 0, 8)}, b"\0" * 8), "dtype 'f32'"),
    "negative shape": (blob({"a": entry("F32", [-1, -256], 0, 8)}, b"\0" * 8), "shape [-1, -256]"),
    "float shape": (blob(None, b"\0" * 8, raw=b'{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}'), "shape"),
    "bool shape": (blob(None, b"\0" * 8, raw=b'{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,8]}}'), "shape"),
    "three offsets": (blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}}, b"\0" * 8), "two"),
    "a field missing": (blob({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, b"\0" * 8), "not exactly the fields"),
    "a field twice": (
        blob(None, b"\0" * 8, raw=b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
        "names 'dtype' twice",
    ),
    "metadata twice": (blob(None, raw=b'{"__metadata__":{},"__metadata__":{}}'), "names '__metadata__' twice"),
    "metadata not strings": (blob({"__metadata__": {"a": 1}}), "not an object of strings"),
    "a list": (blob([]), "JSON list"),
    "not JSON": (blob(None, raw=b"{nope"), "not valid JSON"),
    "NUL padding": (blob(None, b"\0" * 8, raw=b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}\0'), "JSON"),
    "byte order mark": (blob(None, raw=b"\xef\xbb\xbf{}"), "not valid JSON"),
    "not UTF-8": (blob(None, b"\0" * 8, raw=b'{"\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'), "UTF-8"),
    "lone surrogate name": (
        blob(None, b"\0" * 8, raw=b'{"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
        "lone surrogate",
    ),
    "deep nesting": (blob(None, raw=b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "JSON"),
    "header over the limit": (struct.pack("<Q", MAX_HEADER + 1) + b"{}", "over safetensors' limit"),
    "header length past the end": (blob({}, length=1000), "runs past the end"),
    "shorter than 8 bytes": (b"\x02\0\0", "shorter than the 8 bytes"),
}

# Accepted by safetensors, refused here: never written by stagesafe, and ambiguous or unusable.
STRICTER = {
    "a tensor name twice": (
        blob(None, b"\0" * 8, raw=b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
             b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
        "names 'a' twice",
    ),
    "an unknown field": (blob({"a": {**F32x2, "x": 1}}, b"\0" * 8), "not exactly the fields"),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_what_safetensors_reads_is_read_alike(case):
    data = ACCEPTED[case]
    assert safetensors_reads(data)
    header = ours(data)
    expected = safetensors.torch.load(data)
    assert {t.name for t in header.tensors} == set(expected)
    for t in header.tensors:
        assert (t.dtype, t.shape) == (str(expected[t.name].dtype).removeprefix("torch."), tuple(expected[t.name].shape))
        assert header.data_start + t.end <= len(data)


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_safetensors_refuses_is_refused_with_a_clear_message(case):
    data, message = REFUSED[case]
    assert not safetensors_reads(data)
    with pytest.raises(HandoffCorruptError, match="'x': shard 'f' is not a safetensors file") as info:
        ours(data)
    assert message in str(info.value)
    assert len(str(info.value)) < 600  # whatever the file holds, the message is one short line


@pytest.mark.parametrize("case", list(STRICTER))
def test_duplicate_names_and_unknown_fields_are_refused_though_safetensors_reads_them(case):
    data, message = STRICTER[case]
    assert safetensors_reads(data)
    with pytest.raises(HandoffCorruptError, match=message):
        ours(data)


def test_the_length_alone_is_checked_before_the_header_is_read():
    with pytest.raises(HandoffCorruptError, match="over safetensors' limit"):
        header_length(struct.pack("<Q", 2**63), 2**40, source="f")
    with pytest.raises(HandoffCorruptError, match="runs past the end"):
        header_length(struct.pack("<Q", 4096), 2**10, source="f")
    assert header_length(struct.pack("<Q", 16), 24, source="f") == 16


def test_a_megabyte_name_is_shown_cut_short():
    name = "n" * 2**20
    data = blob({name: entry("F128", [1], 0, 4)}, b"\0" * 4)
    with pytest.raises(HandoffCorruptError) as info:
        ours(data)
    assert len(str(info.value)) < 600 and "chars)" in str(info.value)


def test_written_headers_are_read_back_and_by_safetensors():
    specs = {
        "w": {"dtype": "bfloat16", "shape": [3, 2]},
        "é": {"dtype": "float8_e4m3fn", "shape": [5]},
        "empty": {"dtype": "float32", "shape": [0, 4]},
        "s": {"dtype": "int64", "shape": []},
    }
    header, size = encode_header(specs)
    data = header + bytes(size - len(header))
    parsed = ours(data)
    assert [(t.name, t.dtype, list(t.shape)) for t in parsed.tensors] == [
        (name, spec["dtype"], spec["shape"]) for name, spec in specs.items()
    ]
    assert parsed.metadata == {"format": "pt"} and len(header) % 8 == 0
    assert set(safetensors.torch.load(data)) == set(specs)


@pytest.mark.parametrize(
    ("name", "dtype", "shape", "message"),
    [
        ("__metadata__", "float32", [1], "reserves"),
        ("a\ud800", "float32", [1], "lone surrogate"),
        ("", "float32", [1], "non-empty str"),
        (3, "float32", [1], "key 3 must be a non-empty str"),
        ("a", "complex128", [1], "dtype 'complex128'"),
        ("a", "float32", [-1, -256], "shape [-1, -256]"),
        ("a", "float32", [True], "shape [True]"),
        ("a", "float32", [2**62, 4], "below 2**64"),
        ("a", "float32", [0, 2**63], "below 2**63"),
    ],
)
def test_what_safetensors_cannot_store_is_refused_before_writing(name, dtype, shape, message):
    with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[").replace("*", r"\*")):
        check_tensor(name, dtype, shape)
    with pytest.raises(InvalidArgumentError):
        encode_header({"ok": {"dtype": "float32", "shape": [1]}, name: {"dtype": dtype, "shape": shape}})


def test_every_dtype_the_format_stores_round_trips_through_safetensors():
    for dtype in ("bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                  "bfloat16", "float32", "float64", "complex64", "float8_e4m3fn", "float8_e5m2"):
        tensor = torch.zeros(3, dtype=getattr(torch, dtype))
        data = safetensors.torch.save({"t": tensor})
        (entry_,) = ours(data).tensors
        assert (entry_.dtype, entry_.shape) == (dtype, (3,))
