"""The safetensors header: the one reader and writer of it, with every check safetensors makes.

Pure (no torch, no fsspec), so that ``verify``, every load and ``inspect`` refuse exactly the same headers, and
the writer can never write one they refuse. A header is read and checked in full before any tensor is mapped
or allocated: its length against safetensors' limit and the file size; strict UTF-8 and JSON (no duplicate key
at any level, no lone surrogate, no NaN); known dtypes; shapes and offsets that are non-negative integers
below 2**64 whose product does not overflow; offsets that tile the data section from 0 to the end of the file
with no gap and no overlap, each tensor's byte count being its element count times its dtype's size.

Rules are those of safetensors 0.8 (``Metadata::validate`` and its serde types), plus two it does not make:
a tensor name given twice is refused (safetensors keeps the last), and so is a field other than ``dtype``,
``shape`` and ``data_offsets`` (safetensors ignores it). Neither is ever written here. Dtypes safetensors knows
but torch does not (``F4``, ``F6_*``) are refused too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stagesafe.errors import HandoffCorruptError, InvalidArgumentError, clip, shown

__all__ = [
    "MAX_HEADER",
    "SAFETENSORS_DTYPES",
    "Header",
    "TensorEntry",
    "check_name",
    "check_tensor",
    "encode_header",
    "header_length",
    "itemsize",
    "nbytes",
    "parse_header",
    "plainly_valid",
]

MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE
_USIZE = 2**64  # safetensors' shapes, offsets and sizes are u64 (usize); products are checked for overflow
_TORCH_DIM = 2**63  # torch's sizes are int64: a larger dimension (possible with a 0 beside it) cannot be loaded

# safetensors header dtype codes -> (torch dtype name as the manifest records it, bytes per element).
_DTYPES = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "C64": ("complex64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
}
SAFETENSORS_DTYPES = {code: torch_name for code, (torch_name, _) in _DTYPES.items()}
_CODES = {torch_name: code for code, (torch_name, _) in _DTYPES.items()}
_ITEMSIZE = {torch_name: size for torch_name, size in _DTYPES.values()}
_FIELDS = ("dtype", "shape", "data_offsets")
_json_string = json.encoder.encode_basestring_ascii  # a str as json.dumps writes it (ensure_ascii)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a header: ``begin``/``end`` are offsets into the data section, as the file has them."""

    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A checked header: its tensors in the header's order, its metadata, where the data section starts."""

    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str] | None
    data_start: int  # 8 + the header's length: the file offset of data_offsets 0


class _Refused(ValueError):
    """What is wrong with a header; :func:`parse_header` adds which file and what to do."""


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name the format stores (``"bfloat16"`` -> 2)."""
    return _ITEMSIZE[dtype]


def nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Bytes of a tensor of torch dtype name ``dtype`` and ``shape``."""
    return _numel(shape) * _ITEMSIZE[dtype]


def header_length(prefix: bytes, file_size: int, *, source: str) -> int:
    """The header's length, from the file's first 8 bytes, checked against safetensors' limit and the file size."""
    try:
        return _header_length(prefix, file_size)
    except _Refused as exc:
        raise _corrupt(source, exc) from None


def parse_header(raw: bytes | bytearray | memoryview, file_size: int, *, source: str) -> Header:
    """Check and read the header of a safetensors file of ``file_size`` bytes; ``raw`` holds at least its first
    ``8 + header length`` bytes. ``source`` names the file in the ``HandoffCorruptError`` raised for a bad one."""
    try:
        return _parse(raw, file_size)
    except _Refused as exc:
        raise _corrupt(source, exc) from None


def check_name(name: Any, *, where: str = "state_dict") -> None:
    """Raise ``InvalidArgumentError`` unless ``name`` is a tensor name safetensors can store and read back."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(
            f"{where} key {shown(name)} must be a non-empty str; safetensors names tensors by str"
        )
    if name == "__metadata__":
        raise InvalidArgumentError(
            f"{where} key '__metadata__' is the name safetensors reserves for a file's metadata; rename the tensor"
        )
    if not _is_utf8(name):
        raise InvalidArgumentError(
            f"{where} key {shown(name)} is not valid Unicode (a lone surrogate?); safetensors stores UTF-8 names"
        )


def check_tensor(name: Any, dtype: Any, shape: Any, *, where: str = "state_dict") -> None:
    """Raise ``InvalidArgumentError`` unless safetensors can store a tensor ``name`` of torch dtype name
    ``dtype`` and ``shape``, and every reader of the format can read it back."""
    if plainly_valid(name, dtype, shape):
        return
    check_name(name, where=where)
    if not isinstance(dtype, str) or dtype not in _CODES:
        raise InvalidArgumentError(
            f"{where}[{shown(name)}] has dtype {shown(dtype)}, which safetensors cannot store; convert it first "
            f"(it stores {', '.join(sorted(_CODES))})"
        )
    if (
        not isinstance(shape, Sequence)
        or isinstance(shape, (str, bytes))
        or not all(_is_dim(d) for d in shape)
        or _numel_or_none(shape) is None
        or _numel(shape) * _ITEMSIZE[dtype] >= _USIZE
    ):
        raise InvalidArgumentError(
            f"{where}[{shown(name)}] has shape {shown(shape)}; safetensors stores a list of non-negative "
            "integers whose product, in bytes, is below 2**64 (and torch holds each below 2**63)"
        )


def encode_header(specs: Mapping[str, Mapping[str, Any]]) -> tuple[bytes, int]:
    """The header (8-byte length + JSON, padded with spaces to 8) of tensors ``name -> {"dtype", "shape"}`` stored
    in this order, and the size of the whole file. Every tensor is checked first (:func:`check_tensor`)."""
    # The JSON that json.dumps(entries, separators=(",", ":")) writes, one entry at a time without a dict per
    # tensor (this runs for every tensor of every shard). "pt": transformers' loaders insist on it.
    entries = ['{"__metadata__":{"format":"pt"}']
    offset = 0
    for name, spec in specs.items():
        dtype, shape = spec["dtype"], spec["shape"]
        check_tensor(name, dtype, shape, where="tensor")
        size = _numel(shape) * _ITEMSIZE[dtype]
        entries.append(
            f'{_json_string(name)}:{{"dtype":"{_CODES[dtype]}","shape":[{",".join(map(str, shape))}],'
            f'"data_offsets":[{offset},{offset + size}]}}'
        )
        offset += size
    raw = (",".join(entries) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, 8 + len(raw) + offset


# -- internals -----------------------------------------------------------------------------------------------------


def plainly_valid(name: Any, dtype: Any, shape: Any) -> bool:
    """:func:`check_tensor`'s rules, for the common case only (exact ``str``, ``list``/``tuple`` and ``int``
    types): True means valid; False means the full checks decide, and say what is wrong. One pass, no ABCs:
    this runs for every tensor of every header and manifest."""
    if type(name) is not str or not name or name == "__metadata__" or type(dtype) is not str:
        return False
    size = _ITEMSIZE.get(dtype)
    if size is None or (type(shape) is not list and type(shape) is not tuple):
        return False
    n = size
    for d in shape:
        if type(d) is not int or not 0 <= d < _TORCH_DIM:
            return False
        n *= d
        if n >= _USIZE:
            return False
    return _is_utf8(name)


def _corrupt(source: str, exc: _Refused) -> HandoffCorruptError:
    return HandoffCorruptError(
        f"{source} is not a safetensors file safetensors would read: {exc}; it was damaged or not written by "
        "stagesafe, write the handoff again"
    )


def _header_length(prefix: bytes | bytearray | memoryview, file_size: int) -> int:
    if len(prefix) < 8 or file_size < 8:
        raise _Refused(f"it is {file_size} bytes, shorter than the 8 bytes of a header's length")
    length = int.from_bytes(bytes(prefix[:8]), "little")
    if length > MAX_HEADER:
        raise _Refused(f"its header length {length} is over safetensors' limit of {MAX_HEADER} bytes")
    if 8 + length > file_size:
        raise _Refused(f"its header length {length} runs past the end of the file ({file_size} bytes)")
    return length


def _parse(raw: bytes | bytearray | memoryview, file_size: int) -> Header:
    length = _header_length(raw, file_size)
    if len(raw) < 8 + length:
        raise _Refused(f"only {len(raw) - 8} of its {length} header bytes could be read")
    try:
        text = bytes(raw[8 : 8 + length]).decode("utf-8")
        doc = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise _Refused(f"its header is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise _Refused("its header is JSON nested too deeply") from None
    except _Refused:
        raise
    except ValueError as exc:  # JSONDecodeError, and ints of more digits than Python converts
        raise _Refused(f"its header is not valid JSON ({clip(str(exc), 160)})") from None
    if not isinstance(doc, dict):
        raise _Refused(f"its header is a JSON {type(doc).__name__}, not an object")
    metadata = None
    tensors = []
    for name, entry in doc.items():
        if not _is_utf8(name):
            raise _Refused(f"the name {shown(name)} holds a lone surrogate, which is not Unicode")
        if name == "__metadata__":
            metadata = _metadata(entry)
        else:
            tensors.append(_entry(name, entry))
    data_start = 8 + length
    position = 0
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):  # safetensors' order
        if t.begin != position or t.end < t.begin:
            raise _Refused(
                f"tensor {shown(t.name)} has data_offsets [{t.begin}, {t.end}], which leave a gap or overlap "
                f"another tensor (the next tensor must start at {position})"
            )
        if t.end - t.begin != nbytes(t.dtype, t.shape):
            raise _Refused(
                f"tensor {shown(t.name)} is {t.dtype}{list(t.shape)[:8]}, {nbytes(t.dtype, t.shape)} bytes, but its "
                f"data_offsets [{t.begin}, {t.end}] hold {t.end - t.begin}"
            )
        position = t.end
    if data_start + position != file_size:
        raise _Refused(
            f"its tensors cover {position} bytes of data but the file holds {file_size - data_start} after the header"
        )
    return Header(tensors=tuple(tensors), metadata=metadata, data_start=data_start)


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) and _is_utf8(v + k) for k, v in value.items()):
        raise _Refused(f"its __metadata__ is {shown(value)}, not an object of strings")
    return value


def _entry(name: str, entry: Any) -> TensorEntry:
    if not isinstance(entry, dict) or set(entry) != set(_FIELDS):
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise _Refused(f"tensor {shown(name)} has {shown(got)}, not exactly the fields {list(_FIELDS)}")
    code, shape, offsets = (entry[field] for field in _FIELDS)
    if code not in _DTYPES:
        raise _Refused(f"tensor {shown(name)} has dtype {shown(code)}, not one of {sorted(_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_dim(d) for d in shape):
        raise _Refused(
            f"tensor {shown(name)} has shape {shown(shape)}, not a list of integers in [0, 2**63) (torch's sizes)"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_index(x) for x in offsets):
        raise _Refused(f"tensor {shown(name)} has data_offsets {shown(offsets)}, not two integers in [0, 2**64)")
    dtype = _DTYPES[code][0]
    if _numel_or_none(shape) is None or _numel(shape) * _ITEMSIZE[dtype] >= _USIZE:
        raise _Refused(f"tensor {shown(name)} has shape {shown(shape)}, whose byte count overflows 2**64")
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=offsets[0], end=offsets[1])


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"its header names {shown(key)} twice")
        out[key] = value
    return out


def _no_constant(text: str) -> Any:
    raise _Refused(f"its header holds {text}, which JSON does not allow")


def _is_index(value: Any) -> bool:
    return type(value) is int and 0 <= value < _USIZE


def _is_dim(value: Any) -> bool:
    return type(value) is int and 0 <= value < _TORCH_DIM


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _numel_or_none(shape: Iterable[int]) -> int | None:
    """The product of ``shape``, or ``None`` once it reaches 2**64 (stops early: no huge integers are built)."""
    n = 1
    for d in shape:
        n *= d
        if n >= _USIZE:
            return None
    return n


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
