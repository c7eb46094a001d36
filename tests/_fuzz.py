"""Fuzz targets for hostile files, shared by ``tests/test_fuzz.py`` (a few derandomized examples) and
``benchmarks/fuzz_hostile.py`` (a long run). Each target draws a hostile input with hypothesis, runs the real
readers on it and checks what every reader must keep, whatever the input:

- ``header``: a safetensors file with any header (valid tilings, overlaps, gaps, wrong byte counts, unknown and
  misspelt dtypes, huge and negative shapes, duplicate keys, unknown fields, bad UTF-8 and JSON, lengths past
  the end). The codec refuses every file safetensors refuses; what it reads, safetensors reads alike; it refuses
  more only for the documented reasons (a name or field given twice, an unknown field, a dtype torch lacks).
- ``handoff``: a real handoff, then a forged shard (manifest hash and size made to match), a mutated manifest
  (checksum recomputed) or index, or a file replaced by a FIFO, a directory, a device or a link leaving the
  folder. Every reader and the CLI raise only the handoff errors (exit 0, 1 or 2, never ``builtins.X``);
  ``verify`` refuses whatever a load refuses; what loads equals safetensors' own reading of the files; nothing
  outside the folder is opened.
- ``rank_files``: a ZeRO checkpoint in DeepSpeed's layout (stage 2 or 3, 1 to 3 ranks) whose pickled states get
  hostile values (counts, names, shapes, tensors of any dtype, stride and size, structures of the wrong type), or
  whose files get flipped bytes, truncation, a ``byteorder`` record inflating to 2 GiB, a second ``data.pkl``,
  or are replaced by FIFOs and links; client state may hold the values users keep in hyperparameters (paths,
  numpy values, datetimes, Enum members, dataclasses). Reading and ``consolidate`` raise only
  ``CheckpointFormatError``/``UnsafeCheckpointError`` (CLI exit 2), leave nothing at the destination when they
  fail, write a handoff that verifies and loads as the checkpoint reads when they succeed, and open nothing
  outside the two folders.

- ``pickles``: the pickle of a rank file alone (``data.pkl``), as an attacker writes it: DeepSpeed's pickles and
  torch.save's with bytes flipped, cut, inserted or deleted and live payloads spliced in (``os.system``,
  ``builtins.exec``, ``INST``, ``OBJ``, ``EXT1``, allow-listed globals given an attacker's arguments, classes and
  functions outside the tables that create files), or opcode streams built from pieces (the values users keep in
  hyperparameters among them), or the crafted pickles of issue 25 at random sizes (sets by the million, keys of
  one hash, copies of copies, stand-ins sharing their parts at every level). The reader returns a value or raises
  ``CheckpointFormatError``/``UnsafeCheckpointError`` (one short line naming the file), and raises no audit event
  while it reads (no import, open, exec, call of ``os.system`` or ``subprocess``): nothing a pickle names runs.
  Every payload is live: Python's pickle runs it (``tests/test_fuzz.py`` checks that).

Every case of every target keeps a bound on time (:data:`CASE_SECONDS`) and on memory (:data:`CASE_MEMORY_MB`
above the process's peak before the first case): a case past either fails as a broken property.

A crash (SIGSEGV, SIGBUS) or a hang cannot be caught in the process: callers run targets in a child process
with a watchdog (:func:`run` arms ``faulthandler`` per case).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import faulthandler
import io
import json
import math
import os
import pathlib
import re
import shutil
import struct
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import numpy as np
from _hostile import (
    INDEX,
    MANIFEST,
    audit_events,
    byte_copies,
    byteorder_bomb,
    colliding_int_keys,
    duplicate_pickle,
    empty_sets,
    forge_manifest,
    loss_scaler_levels,
    opened_files,
    outside,
    safetensors_bytes,
    set_calls_of_a_big_list,
    write_zero_checkpoint,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

__all__ = ["TARGETS", "run"]

CASE_TIMEOUT = 60  # seconds a single case may take before the watchdog calls it a hang and exits
CASE_SECONDS = {"pickles": 10.0}  # a case that takes longer breaks a property (others: CASE_TIMEOUT)
CASE_MEMORY_MB = 512  # no case may raise the process's peak RSS this far above its peak before the first

_CODES = {  # safetensors code -> bytes per element; F4/F6 are safetensors' own, which torch lacks
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F16": 2,
    "BF16": 2, "F32": 4, "F64": 8, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
}  # fmt: skip
_OUTSIDE_OURS = {"F4", "F6_E2M3", "F6_E3M2"}


# -- safetensors headers -------------------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "w.0", "", "é", "__metadata__", "a\ud800", "a" * 300]) | st.text(max_size=4)
DIMS = st.integers(0, 4) | st.sampled_from([-1, 2**31, 2**40, 2**63, 2**64, 2**70])


@st.composite
def safetensors_files(draw) -> bytes:
    """A safetensors file, valid or nearly, then perhaps damaged."""
    entries: dict[str, Any] = {}
    raw_pairs: list[str] = []
    position = 0
    if draw(st.booleans()):
        entries["__metadata__"] = draw(
            st.sampled_from([{"format": "pt"}, None, {"a": 1}, [], {"k": "v" * 10}, "x"])
        )
    for _ in range(draw(st.integers(0, 4))):
        name = draw(NAMES)
        code = draw(st.sampled_from([*_CODES, *_OUTSIDE_OURS, "F128", "f32", ""]))
        shape = draw(st.lists(DIMS, max_size=3))
        numel = math.prod(shape) if all(d >= 0 for d in shape) else 1
        size = numel * _CODES.get(code, 1) if numel < 2**20 else 8
        begin, end = position, position + size
        how = draw(st.sampled_from(["tile"] * 6 + ["overlap", "gap", "short", "long", "reverse", "huge"]))
        begin, end = {
            "tile": (begin, end),
            "overlap": (max(0, begin - 4), end),
            "gap": (begin + 4, end + 4),
            "short": (begin, max(begin, end - 1)),
            "long": (begin, end + 1),
            "reverse": (end, begin),
            "huge": (begin, 2**64 + end),
        }[how]
        position = max(position, end if end < 2**40 else position)
        entry: dict[str, Any] = {"dtype": code, "shape": shape, "data_offsets": [begin, end]}
        field = draw(st.sampled_from([None] * 8 + ["extra", "missing", "float", "bool", "three"]))
        if field == "extra":
            entry["x"] = 1
        elif field == "missing":
            del entry["shape"]
        elif field == "float":
            entry["shape"] = [float(d) for d in shape] or [1.0]
        elif field == "bool":
            entry["shape"] = [True]
        elif field == "three":
            entry["data_offsets"] = [begin, end, end]
        if name in entries or draw(st.integers(0, 9)) == 0:
            raw_pairs.append(json.dumps({name: entry})[1:-1])  # a key given twice in the text
        entries[name] = entry
    text = json.dumps(entries)
    if raw_pairs:
        text = text[:-1] + (", " if entries else "") + ", ".join(raw_pairs) + "}"
    raw = text.encode("utf-8", "surrogatepass")
    damage = draw(st.sampled_from([None] * 6 + ["nul", "bom", "deep", "flip", "cut", "utf8", "nan"]))
    if damage == "nul":
        raw += b"\0"
    elif damage == "bom":
        raw = b"\xef\xbb\xbf" + raw
    elif damage == "deep":
        raw = b'{"__metadata__":' + b"[" * 5000 + b"]" * 5000 + b"}"
    elif damage == "flip" and raw:
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([raw[at] ^ (1 << draw(st.integers(0, 7)))]) + raw[at + 1 :]
    elif damage == "cut":
        raw = raw[: draw(st.integers(0, len(raw)))]
    elif damage == "utf8":
        raw = raw.replace(b'"a"', b'"\xff"', 1)
    elif damage == "nan":
        raw = raw.replace(b"[0,", b"[NaN,", 1).replace(b"[0, ", b"[NaN, ", 1)
    data = bytes(draw(st.sampled_from([position, position, position, position + 1, max(0, position - 1), 0])))
    blob = safetensors_bytes(None, data, raw=raw)
    if draw(st.integers(0, 9)) == 0:
        blob = struct.pack("<Q", draw(st.sampled_from([0, 7, 2**63, 100_000_001, len(blob)]))) + blob[8:]
    return blob


def _stricter_reason(blob: bytes) -> str | None:
    """Why the codec may refuse a file safetensors reads: a key given twice, an unknown field, a dtype torch lacks,
    a size torch cannot hold (2**63 or more: safetensors' loaders then fail in torch with a TypeError)."""
    length = int.from_bytes(blob[:8], "little")
    duplicated = []

    def pairs(items):
        keys = [k for k, _ in items]
        duplicated.extend(k for k in keys if keys.count(k) > 1)
        return dict(items)

    doc = json.loads(blob[8 : 8 + length], object_pairs_hook=pairs)
    if duplicated:
        return "duplicate"
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        if set(entry) != {"dtype", "shape", "data_offsets"} or entry["dtype"] in _OUTSIDE_OURS:
            return "field or dtype"
        if any(isinstance(d, int) and d >= 2**63 for d in entry["shape"]):
            return "size"
    return None


def check_header(blob: bytes) -> str:
    """The codec against safetensors on one file; returns the outcome, raises AssertionError on a disagreement."""
    from safetensors import deserialize

    from stagesafe.errors import HandoffCorruptError
    from stagesafe.handoff.codec import parse_header

    try:
        theirs = {name: (info["dtype"], list(info["shape"])) for name, info in deserialize(blob)}
    except Exception:  # noqa: BLE001 - SafetensorError and friends: refused
        theirs = None
    try:
        header = parse_header(blob, len(blob), source="f")
    except HandoffCorruptError as exc:
        assert len(str(exc)) < 1000, str(exc)[:2000]
        if theirs is not None:
            assert _stricter_reason(blob), f"safetensors reads it, the codec refuses it: {exc}"
        return "refused"
    assert theirs is not None, f"the codec reads a file safetensors refuses: {header}"
    from stagesafe.handoff.codec import SAFETENSORS_DTYPES

    ours = {t.name: (t.dtype, list(t.shape)) for t in header.tensors}
    assert ours == {n: (SAFETENSORS_DTYPES[c], s) for n, (c, s) in theirs.items()}, (ours, theirs)
    return "read"


# -- handoffs ------------------------------------------------------------------------------------------------------

_READ_ERRORS = ("HandoffCorruptError", "HandoffNotFoundError", "HandoffNotReadyError")  # not ready: an index missing, as a save cut short between its commit and its index leaves it


@st.composite
def state_dicts(draw) -> dict[str, torch.Tensor]:
    n = draw(st.integers(1, 3))
    return {f"t{i}": torch.arange(draw(st.integers(0, 6)), dtype=torch.float32) + i for i in range(n)}


@st.composite
def handoff_cases(draw) -> Callable[[str], None]:
    """A function that damages the handoff at ``root`` (written from :func:`_state_dict`) as an attacker would."""
    kind = draw(st.sampled_from(["shard", "shard", "manifest", "index", "file_kind"]))
    if kind == "shard":
        blob = draw(safetensors_files())
        forge_tensors = draw(st.booleans())

        def damage(root: str) -> None:
            with open(os.path.join(root, MANIFEST)) as f:
                shard = next(iter(json.load(f)["shards"]))
            with open(os.path.join(root, shard), "wb") as f:
                f.write(blob)
            described = _described(blob) if forge_tensors else None

            from stagesafe.handoff.digest import hash_buffer
            from stagesafe.handoff.manifest import digest_of

            def edit(m: dict) -> None:
                m["shards"][shard] = {digest_of(m): hash_buffer(digest_of(m), blob), "size": len(blob)}
                if described is not None:
                    for name in [n for n, f in m["weight_map"].items() if f == shard]:
                        del m["weight_map"][name], m["tensors"][name]
                    m["aliases"] = {}
                    for name, (dtype, shape) in described.items():
                        m["weight_map"][name] = shard
                        m["tensors"][name] = {"dtype": dtype, "shape": shape}

            forge_manifest(root, edit)

        return damage
    if kind in ("manifest", "index"):
        path = draw(st.sampled_from(["weight_map", "tensors", "shards", "aliases", "total_size", "metadata", "top"]))
        value = draw(JSON_VALUES)
        recompute = draw(st.booleans())

        def damage(root: str) -> None:
            name = MANIFEST if kind == "manifest" else INDEX
            with open(os.path.join(root, name)) as f:
                doc = json.load(f)
            _set_somewhere(doc, path, value)
            if kind == "manifest" and recompute:
                from stagesafe.handoff.manifest import manifest_checksum

                with contextlib.suppress(Exception):
                    doc["checksum"] = manifest_checksum(doc)
            with open(os.path.join(root, name), "w") as f:
                f.write(json.dumps(doc) if not isinstance(value, _Deep) else value.wrap(json.dumps(doc)))

        return damage
    which = draw(st.sampled_from(["shard", MANIFEST, INDEX, "index_entry"]))
    into = draw(st.sampled_from(["fifo", "link_to_fifo", "link_outside", "directory", "dev_zero", "dangling"]))

    def damage(root: str) -> None:
        with open(os.path.join(root, MANIFEST)) as f:
            manifest = json.load(f)
        shard = next(iter(manifest["shards"]))
        name = {"shard": shard, "index_entry": "model-00009-of-00009.safetensors"}.get(which, which)
        if which == "index_entry":
            with open(os.path.join(root, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": 0}, "weight_map": {n: name for n in manifest["weight_map"]}}, f)
        path = os.path.join(root, name)
        if os.path.lexists(path):
            os.remove(path)
        if into == "fifo":
            os.mkfifo(path)
        elif into == "link_to_fifo":
            os.mkfifo(path + ".pipe")
            os.symlink(path + ".pipe", path)
        elif into == "link_outside":
            elsewhere = os.path.join(os.path.dirname(root), "other", MANIFEST if which == MANIFEST else shard)
            os.symlink(elsewhere, path)
        elif into == "directory":
            os.mkdir(path)
        elif into == "dev_zero":
            os.symlink("/dev/zero", path)
        else:
            os.symlink(path + ".gone", path)

    return damage


class _Deep:
    """A JSON value nested too deeply for any parser's recursion: spliced into the document as text."""

    def wrap(self, text: str) -> str:
        return text.replace('"__deep__"', "[" * 100_000 + "]" * 100_000, 1)


JSON_VALUES = st.one_of(
    st.sampled_from([None, True, -1, 0, 2**64, 1.5, "", "../other/model-00001-of-00001.safetensors", "/etc/passwd"]),
    st.sampled_from(["model-00001-of-00001.safetensors", "model-00009-of-00009.safetensors", [], {}, ["w"]]),
    st.just("__deep__").map(lambda _: _Deep()),
    st.dictionaries(NAMES, st.sampled_from(["model-00001-of-00001.safetensors", "x", 3, None]), max_size=3),
    st.dictionaries(
        NAMES,
        st.fixed_dictionaries({"dtype": st.sampled_from(["float32", "F128", 1]), "shape": st.lists(DIMS, max_size=2)}),
        max_size=2,
    ),
)


def _set_somewhere(doc: Any, path: str, value: Any) -> None:
    stored = "__deep__" if isinstance(value, _Deep) else value
    if path == "top" or not isinstance(doc, dict):
        doc.clear()
        doc["x"] = stored
    elif isinstance(doc.get(path), dict) and doc[path] and not isinstance(value, dict):
        doc[path][next(iter(doc[path]))] = stored
    else:
        doc[path] = stored


def _described(blob: bytes) -> dict[str, tuple[str, list]] | None:
    """name -> (torch dtype name, shape) as the header says, when it says so legibly."""
    from stagesafe.handoff.codec import SAFETENSORS_DTYPES

    try:
        length = int.from_bytes(blob[:8], "little")
        doc = json.loads(blob[8 : 8 + length])
        return {
            name: (SAFETENSORS_DTYPES.get(e["dtype"], e["dtype"]), e["shape"])
            for name, e in doc.items()
            if name != "__metadata__"
        }
    except Exception:  # noqa: BLE001 - an illegible header: the manifest keeps its tables
        return None


def _escaped(opened: list[str], workdir: str, *folders: str) -> list[str]:
    """Files opened in the case's own folder (or devices) that lie outside ``folders``: another handoff's, say.
    (Imports open files of their own, elsewhere.)"""
    mine = [p for p in opened if p.startswith((workdir, "/dev/")) or os.path.realpath(p).startswith((workdir, "/dev/"))]
    return [p for p in mine if all(outside([p], folder) for folder in folders)]


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as exc:  # noqa: BLE001 - the property is about which errors come out
        return type(exc).__name__, exc


def _cli(*argv: str) -> tuple[int, str]:
    from stagesafe.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


def check_handoff(workdir: str, state_dict: dict[str, torch.Tensor], damage: Callable[[str], None]) -> str:
    """Write a handoff, damage it, run every reader; returns the outcome, raises AssertionError on a violation."""
    from safetensors import deserialize

    from stagesafe import load_state_dict, read_manifest, save_state_dict, verify
    from stagesafe.handoff.read import HandoffReader

    root, other = os.path.join(workdir, "h"), os.path.join(workdir, "other")
    save_state_dict(state_dict, root, max_shard_size=16)
    save_state_dict(state_dict, other, max_shard_size=16)
    damage(root)
    with opened_files() as opened:
        verified = _outcome(lambda: verify(root))
        loaded = _outcome(lambda: load_state_dict(root))
        mapped = _outcome(lambda: load_state_dict(root, verify=False))
        manifest = _outcome(lambda: read_manifest(root))
        streamed = _outcome(lambda: {k: v.clone() for k, v in HandoffReader(root).items()})
        cli = [_cli("verify", root), _cli("inspect", root)]
    assert not _escaped(opened, workdir, root), f"opened outside the folder: {_escaped(opened, workdir, root)[:3]}"
    outcomes = {
        "verify": verified,
        "load": loaded,
        "load(verify=False)": mapped,
        "read_manifest": manifest,
        "HandoffReader": streamed,
    }
    for what, (kind, value) in outcomes.items():
        assert kind == "ok" or kind in _READ_ERRORS, f"{what} raised {kind}: {value}"
        assert kind == "ok" or len(str(value)) < 2000, f"{what}: a message of {len(str(value))} chars"
    for code, err in cli:
        assert code in (0, 1, 2) and "builtins." not in err and len(err.strip().splitlines()) <= 1, (code, err)
    if loaded[0] != "ok":
        assert verified[0] != "ok", f"verify passes what load refuses: {loaded[1]}"
    if verified[0] == "ok":
        assert loaded[0] == "ok", f"verify passed, load raised {loaded[1]}"
    elif loaded[0] == "ok":  # loads do not read the index; verify checks the rest as they do
        assert INDEX in str(verified[1]), f"load passed, verify refused for another reason: {verified[1]}"
    if loaded[0] == "ok":
        assert streamed[0] == "ok" and mapped[0] == "ok", (streamed, mapped)
        on_disk: dict[str, tuple[str, list, bytes]] = {}
        for shard in manifest[1]["shards"]:
            with open(os.path.join(root, shard), "rb") as f:
                for name, info in deserialize(f.read()):
                    on_disk[name] = (info["dtype"], list(info["shape"]), bytes(info["data"]))
        aliases = manifest[1]["aliases"]
        for name, tensor in loaded[1].items():
            _, shape, data = on_disk[aliases.get(name, name)]
            assert list(tensor.shape) == shape and _bytes(tensor) == data, name
            assert _bytes(tensor) == _bytes(mapped[1][name]), name
    return "loaded" if loaded[0] == "ok" else "refused"


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# -- ZeRO rank files -------------------------------------------------------------------------------------------------


@st.composite
def hostile_tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex128]))
    shape = draw(st.lists(st.integers(0, 6), max_size=3))
    t = torch.zeros(shape, dtype=dtype)
    view = draw(st.sampled_from([None] * 4 + ["expand", "transpose", "step", "narrow", "big_expand"]))
    if view == "expand":
        t = torch.zeros(1, dtype=dtype).expand(draw(st.integers(2, 64)))
    elif view == "big_expand":
        t = torch.zeros(1, dtype=dtype).expand(2**24)
    elif view == "transpose" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif view == "step" and t.dim() >= 1:
        t = t[::2]
    elif view == "narrow" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1:]
    return t


class Shade(enum.Enum):
    """A user's Enum: kept in checkpoints' hyperparameters, read as a stand-in."""

    DARK = "dark"


@dataclasses.dataclass
class Setting:
    """A user's dataclass: kept in checkpoints' hyperparameters, read as a stand-in."""

    lr: float = 0.1
    path: pathlib.Path = pathlib.Path("/data")


# The values users keep in hyperparameters and callbacks' state.
USER_VALUES = [
    pathlib.Path("/runs/a"), pathlib.PureWindowsPath("C:/x"), np.float64(0.5), np.int64(-3), np.arange(6).reshape(2, 3),
    np.array([1, "a"], dtype=object), np.dtype(">f4"), datetime.date(2026, 1, 1), datetime.timedelta(seconds=5),
    datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=1))), Shade.DARK, Setting(),
    __import__("argparse").Namespace(a=1, b=[pathlib.Path("p")]),
]  # fmt: skip

HOSTILE_VALUES = st.one_of(
    st.sampled_from([0, 1, -1, 10**12, 2**63, 2**80, True, None, "3", "", 2.5, [], {}, [2, "x"], [-1, -256]]),
    st.sampled_from(USER_VALUES),
    st.text(max_size=4),
    st.lists(st.integers(-3, 6), max_size=3),
    hostile_tensors(),
    st.lists(hostile_tensors(), max_size=2),
)
RANK_NAMES = st.sampled_from(["__metadata__", "a\ud800", "", 7, None, "x" * 500, "w"])

# (kind, path) of a value in the states DeepSpeed pickles; "<param>"/"<buffer>" stand for a key of the dict there.
_SITES = [
    ("optim", ("optimizer_state_dict", "partition_count")),
    ("optim", ("optimizer_state_dict", "zero_stage")),
    ("optim", ("optimizer_state_dict", "<groups>")),
    ("optim", ("optimizer_state_dict", "<groups>", 0)),
    ("optim", ("optimizer_state_dict",)),
    ("model", ("param_shapes", 0, "<param>")),
    ("model", ("param_shapes", 0)),
    ("model", ("param_shapes",)),
    ("model", ("module", "<buffer>")),
    ("model", ("module",)),
    ("model", ("buffer_names",)),
    ("model", ("shared_params",)),
    ("model", ("frozen_param_shapes",)),
    ("model", ("frozen_param_fragments",)),
    ("model", ("ds_version",)),
    ("model", ("epoch",)),
]


@st.composite
def rank_file_cases(draw) -> dict[str, Any]:
    """A checkpoint to write (stage, world size, params, buffers), hostile edits of its states, file damage."""
    stage = draw(st.sampled_from([2, 3]))
    sizes = st.lists(st.integers(1, 4), min_size=1, max_size=2)
    params = {f"p{i}": torch.randn(draw(sizes)) for i in range(draw(st.integers(1, 3)))}
    buffers = draw(st.sampled_from([{}, {"n": torch.arange(3)}, {"s": torch.ones(2, dtype=torch.bfloat16)}]))
    edits = []
    for _ in range(draw(st.integers(0, 3))):
        kind, path = draw(st.sampled_from(_SITES))
        rename = path == ("param_shapes", 0) and draw(st.booleans())
        value = draw(RANK_NAMES) if rename else draw(HOSTILE_VALUES)
        edits.append((kind, draw(st.integers(0, 2)), path, value, rename))
    damage = draw(
        st.sampled_from([None] * 6 + ["flip", "cut", "append", "fifo", "link_outside", "latest", "byteorder", "twice"])
    )
    return {
        "stage": stage,
        "world_size": draw(st.integers(1, 3)),
        "params": params,
        "buffers": buffers,
        "edits": edits,
        "damage": damage,
        "damage_at": draw(st.floats(0, 1)),
        "flip_bit": draw(st.integers(0, 7)),
        "shard_size": draw(st.sampled_from(["64B", "5GB"])),
    }


def _apply(states: dict, path: tuple, value: Any, rename: bool, stage: int) -> None:
    target: Any = states
    for i, key in enumerate(path):
        key = {"<groups>": "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"}.get(key, key)
        if key in ("<param>", "<buffer>"):
            if not isinstance(target, dict) or not target:
                return
            key = next(iter(target))
        last = i == len(path) - 1
        if last and rename:
            if isinstance(target, dict) and isinstance(target.get(key), dict) and target[key]:
                inner = target[key]
                first = next(iter(inner))
                inner[value] = inner.pop(first)
            return
        if last:
            if isinstance(target, dict):
                target[key] = value
            elif isinstance(target, list) and isinstance(key, int) and key < len(target):
                target[key] = value
            return
        try:
            target = target[key]
        except (KeyError, IndexError, TypeError):
            return


def check_rank_files(workdir: str, case: dict[str, Any]) -> str:
    """Write the checkpoint, apply the case, read and consolidate it; raises AssertionError on a violation."""
    from stagesafe import load_state_dict, verify
    from stagesafe.consolidate import load_zero_checkpoint

    src, dst = os.path.join(workdir, "ckpt"), os.path.join(workdir, "out")

    def edit(kind: str, rank: int, states: dict) -> None:
        for e_kind, e_rank, path, value, rename in case["edits"]:
            if e_kind == kind and e_rank == rank:
                _apply(states, path, value, rename, case["stage"])

    write_zero_checkpoint(
        src, case["params"], stage=case["stage"], world_size=case["world_size"], buffers=case["buffers"], edit=edit
    )
    tag_dir = os.path.join(src, "global_step1")
    files = sorted(os.listdir(tag_dir))
    victim = os.path.join(tag_dir, files[int(case["damage_at"] * (len(files) - 1))])
    damage = case["damage"]
    if damage in ("flip", "cut", "append"):
        with open(victim, "r+b") as f:
            data = bytearray(f.read())
            at = int(case["damage_at"] * (len(data) - 1))
            if damage == "flip":
                data[at] ^= 1 << case["flip_bit"]
            elif damage == "cut":
                del data[at:]
            else:
                data += bytes(at % 97)
            f.seek(0)
            f.truncate()
            f.write(data)
    elif damage == "fifo":
        os.remove(victim)
        os.mkfifo(victim)
    elif damage == "link_outside":
        elsewhere = os.path.join(workdir, "elsewhere")
        shutil.copy(victim, elsewhere)
        os.remove(victim)
        os.symlink(elsewhere, victim)
    elif damage == "latest":
        with open(os.path.join(src, "latest"), "w") as f:
            f.write("../" * 2000)
    elif damage == "byteorder":  # a record deflated to 2 MB that inflates to 2 GiB
        byteorder_bomb(victim)
    elif damage == "twice":  # a second data.pkl record: torch would read it, stagesafe the first
        duplicate_pickle(victim, b"\x80\x02}.")
    with opened_files() as opened:
        read = _outcome(lambda: load_zero_checkpoint(src))
        code, err = _cli("consolidate", src, dst, "--max-shard-size", case["shard_size"])
    assert not _escaped(opened, workdir, src, dst), f"opened outside the folders: {_escaped(opened, workdir, src, dst)}"
    assert read[0] in ("ok", "CheckpointFormatError", "UnsafeCheckpointError"), f"read raised {read[0]}: {read[1]}"
    assert "builtins." not in err and len(err.strip().splitlines()) <= 1, err
    if code != 0:
        assert code == 2, (code, err)
        assert not os.path.exists(dst) or not os.listdir(dst), f"a failed consolidate left {os.listdir(dst)}"
        return "refused"
    assert read[0] == "ok", f"consolidate wrote what the reader refuses: {read[1]}"
    verify(dst)
    written = load_state_dict(dst)
    assert list(written) == list(read[1])
    for name, tensor in read[1].items():
        assert _bytes(written[name]) == _bytes(tensor), name
    return "consolidated"


# -- pickles ---------------------------------------------------------------------------------------------------------


def _text(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return b"X" + len(data).to_bytes(4, "little") + data


def _bytes_op(data: bytes) -> bytes:
    return b"B" + len(data).to_bytes(4, "little") + data


def _touch(marker: str) -> str:
    return f"touch {marker}"


# Pieces of pickle that run code under Python's pickle, each creating the file ``marker``: what an attacker
# splices into a rank file's pickle. tests/test_fuzz.py checks that each is live.
PAYLOADS: dict[str, Callable[[str], bytes]] = {
    "global_reduce": lambda m: b"cposix\nsystem\n(" + _text(_touch(m)) + b"tR",
    "os_system": lambda m: b"cos\nsystem\n" + _text(_touch(m)) + b"\x85R",
    "stack_global": lambda m: _text("os") + _text("system") + b"\x93" + _text(_touch(m)) + b"\x85R",
    "exec": lambda m: b"cbuiltins\nexec\n" + _text(f"open({m!r}, 'w').close()") + b"\x85R",
    "eval_py2_name": lambda m: b"c__builtin__\neval\n" + _text(f"open({m!r}, 'w')") + b"\x85R",
    "open": lambda m: b"cbuiltins\nopen\n" + _text(m) + _text("w") + b"\x86R",
    "inst": lambda m: b"(" + _text(_touch(m)) + b"ios\nsystem\n",
    "obj": lambda m: b"(cos\nsystem\n" + _text(_touch(m)) + b"o",
    "subprocess": lambda m: b"csubprocess\nrun\n](" + _text("touch") + _text(m) + b"e\x85R",
    "getattr_chain": lambda m: b"cbuiltins\ngetattr\ncbuiltins\n__import__\n" + _text("os") + b"\x85R"
    + _text("system") + b"\x86R" + _text(_touch(m)) + b"\x85R",
    "reduce_of_allowed_then_refused": lambda m: b"ccollections\nOrderedDict\n)R" + b"cos\nsystem\n"
    + _text(_touch(m)) + b"\x85R" + b"\x86",
    "build_setstate": lambda m: b"ccollections\nOrderedDict\n)R}" + _text("__setstate__") + b"cos\nsystem\n"
    + b"sb" + _text(_touch(m)) + b"b",
    "torch_load_bytes": lambda m: b"ctorch.storage\n_load_from_bytes\n" + _bytes_op(b"\x80\x02" + PAYLOADS["os_system"](m) + b".")
    + b"\x85R",
    # names outside the tables: a class (a stand-in: nothing runs), a function (refused), a user's class
    "class_outside": lambda m: b"czipfile\nZipFile\n" + _text(m) + _text("w") + b"\x86R",
    "function_outside": lambda m: b"cgzip\nopen\n" + _text(m) + _text("w") + b"\x86R",
    "user_class": lambda m: b"c_fuzz\nWritesWhenBuilt\n" + _text(m) + b"\x85R",
    "user_class_newobj": lambda m: b"c_fuzz\nWritesWhenBuilt\n" + _text(m) + b"\x85\x81",
}


class WritesWhenBuilt:
    """A user's class whose constructor creates the file it is given: live under pickle by REDUCE, and by NEWOBJ
    (its ``__new__``)."""

    def __new__(cls, path: str):
        with open(path, "w"):
            pass
        return super().__new__(cls)

# Pieces of DeepSpeed's pickles, for streams built from pieces: each pushes, pops or builds something.
_PIECES = [
    b"(", b")", b"]", b"}", b"\x8f", b"0", b"1", b"2", b"N", b"\x88", b"\x89", b"K\x07", b"M\xff\x00",
    b"J\xff\xff\xff\xff", b"\x8a\x01\x80", b"\x8a\x00", b"G?\xf0\x00\x00\x00\x00\x00\x00", b"\x8c\x01w",
    _text("optimizer_state_dict"), _text("storage"), _text("0"), _text("cpu"), b"C\x02ab", b"t", b"\x85", b"\x86",
    b"\x87", b"a", b"e", b"s", b"u", b"\x90", b"\x91", b"q\x00", b"q\x01", b"h\x00", b"h\x01", b"\x94",
    b"r\x00\x00\x00\x00", b"j\x00\x00\x00\x00", b"R", b"\x81", b"b", b"Q", b"\x92",
    b"ctorch._utils\n_rebuild_tensor_v2\n", b"ctorch._utils\n_rebuild_parameter\n",
    b"ctorch._tensor\n_rebuild_from_type_v2\n", b"ctorch\nFloatStorage\n", b"ctorch\nBFloat16Storage\n",
    b"ctorch\nbfloat16\n", b"ctorch\nSize\n", b"ctorch\ndevice\n", b"ctorch\nTensor\n",
    b"ccollections\nOrderedDict\n", b"c__builtin__\nset\n", b"cbuiltins\nfrozenset\n", b"c_codecs\nencode\n",
    b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n", b"cdeepspeed.runtime.zero.config\nZeroStageEnum\n",
    b"clightning.fabric.utilities.data\nAttributeDict\n", b"cargparse\nNamespace\n",
    b"(\x8c\x07storagectorch\nFloatStorage\n\x8c\x010\x8c\x03cpuK\x04tQ",  # a storage's persistent id
    b"K\x00K\x04\x85K\x01\x85\x89ccollections\nOrderedDict\n)R\x86",  # offset, size, stride, grad, hooks
    # the values users keep in hyperparameters, and names outside the tables
    b"cpathlib\nPosixPath\n", b"cpathlib._local\nPureWindowsPath\n", b"cnumpy\ndtype\n", b"cnumpy\nndarray\n",
    b"cnumpy._core.multiarray\nscalar\n", b"cnumpy.core.multiarray\n_reconstruct\n", b"cdatetime\ndatetime\n",
    b"cdatetime\ntimezone\n", b"cdatetime\ntimedelta\n", b"ccopy_reg\n_reconstructor\n", b"c__builtin__\nobject\n",
    b"cmypkg.config\nConfig\n", b"cmypkg\nhelper\n", _text("f8"), _text("latin1"),
    b"C\x08\x00\x00\x00\x00\x00\x00\xf8?",  # the bytes of 1.5
    b"X\x01\x00\x00\x00<", b"K\x03X\x01\x00\x00\x00<NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t",  # a dtype's state
    b"\x8a\t\xff\xff\xff\xff\xff\xff\xff\x1f\x00", b"\x8a\t\xfe\xff\xff\xff\xff\xff\xff?\x00",  # ints of one hash
]


def _seed_pickles() -> list[bytes]:
    """The pickles of a real ZeRO-2 and ZeRO-3 checkpoint's rank files, of torch.save's other shapes, and of the
    values users keep in hyperparameters."""
    import zipfile

    seeds = []
    with tempfile.TemporaryDirectory() as folder:
        params = {"w": torch.ones(3, 2), "b": torch.ones(3)}
        for stage in (2, 3):
            src = write_zero_checkpoint(
                os.path.join(folder, str(stage)), params, stage=stage, buffers={"s": torch.ones(2, dtype=torch.bfloat16)}
            )
            tag = os.path.join(src, "global_step1")
            for name in sorted(os.listdir(tag))[:2]:
                with zipfile.ZipFile(os.path.join(tag, name)) as archive:
                    seeds.append(archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl"))))
    base = torch.arange(6.0).view(2, 3)
    other = {
        "view": base[:, ::2], "p": torch.nn.Parameter(torch.ones(2)), "u16": torch.ones(2, dtype=torch.uint16),
        "size": torch.Size([2, 3]), "device": torch.device("cpu"), "dtype": torch.bfloat16, "set": {1, 2},
        "frozen": frozenset({"a"}), "bytes": b"\x00\xff", "array": bytearray(b"ab"), "od": OrderedDict(a=[1, (2, 3)]),
    }  # fmt: skip
    for obj in (other, {"hyper_parameters": {f"v{i}": value for i, value in enumerate(USER_VALUES)}}):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        with zipfile.ZipFile(buffer) as archive:
            seeds.append(archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl"))))
    return seeds


_SEEDS: list[bytes] = []

_MUTATION = st.one_of(
    st.tuples(st.just("payload"), st.floats(0, 1), st.sampled_from(sorted(PAYLOADS))),
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 7)),
    st.tuples(st.just("cut"), st.floats(0, 1)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("piece"), st.floats(0, 1), st.sampled_from(range(len(_PIECES)))),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 16)),
)


# The crafted pickles of issue 25, at a scale from 1 to 16: a case takes milliseconds to a tenth of a second.
BOMBS: dict[str, Callable[[int], bytes]] = {
    "empty_sets": lambda n: empty_sets(n * 2**16),
    "colliding_int_keys": lambda n: colliding_int_keys(n * 100),
    "set_calls_of_a_big_list": lambda n: set_calls_of_a_big_list(n * 20_000, 100),
    "bytearray_copies": lambda n: byte_copies(n * 2**14, 300, "bytearray"),
    "encode_copies": lambda n: byte_copies(n * 2**14, 300, "encode"),
    "loss_scaler_levels": lambda n: loss_scaler_levels(n * 8),
}


@st.composite
def pickle_cases(draw) -> tuple:
    """("mutated", seed index, mutations), ("pieces", protocol byte, [piece index or payload name]) or ("bomb",
    name, scale)."""
    kind = draw(st.sampled_from(["mutated"] * 3 + ["pieces"] * 3 + ["bomb"]))
    if kind == "mutated":
        return "mutated", draw(st.integers(0, 5)), draw(st.lists(_MUTATION, min_size=1, max_size=4))
    if kind == "bomb":
        return "bomb", draw(st.sampled_from(sorted(BOMBS))), draw(st.integers(1, 16))
    tokens = st.one_of(st.sampled_from(range(len(_PIECES))), st.sampled_from(sorted(PAYLOADS)))
    return "pieces", draw(st.sampled_from([2, 4, 5, 6])), draw(st.lists(tokens, max_size=24))


def build_pickle(case: tuple, marker: str) -> bytes:
    """The bytes of a pickle case, its payloads creating ``marker`` if they ever run."""
    if case[0] == "bomb":
        return BOMBS[case[1]](case[2])
    if case[0] == "pieces":
        body = b"".join(PAYLOADS[t](marker) if isinstance(t, str) else _PIECES[t] for t in case[2])
        return b"\x80" + bytes([case[1]]) + body + b"."
    if not _SEEDS:
        _SEEDS.extend(_seed_pickles())
    data = bytearray(_SEEDS[case[1] % len(_SEEDS)])
    for kind, where, *arg in case[2]:
        at = int(where * len(data))
        if kind == "payload":
            data[at:at] = PAYLOADS[arg[0]](marker)
        elif kind == "flip" and data:
            data[min(at, len(data) - 1)] ^= 1 << arg[0]
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = arg[0]
        elif kind == "piece":
            data[at:at] = _PIECES[arg[0]]
        elif kind == "delete":
            del data[at : at + arg[0]]
    return bytes(data)


_HARMLESS_EVENTS = {"builtins.id"}  # reprlib's bounded repr of a value for an error message asks for ids


def check_pickle(workdir: str, case: tuple) -> str:
    """Read a crafted pickle; raises AssertionError on a violation."""
    import pickletools  # noqa: F401 - the reader imports it to name an unknown opcode: loaded before, not while

    from stagesafe.zero.pickle_reader import read_pickle

    marker = os.path.join(workdir, "ran")
    data = build_pickle(case, marker)
    display = "fuzz/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with audit_events() as events:
        kind, value = _outcome(lambda: read_pickle(data, display=display))
    ran = [event for event in events if event not in _HARMLESS_EVENTS]
    assert not ran, f"reading raised the audit events {ran[:8]}"
    assert not os.path.exists(marker), "a payload ran"
    assert kind in ("ok", "CheckpointFormatError", "UnsafeCheckpointError"), f"read raised {kind}: {value!r}"
    if kind != "ok":
        message = str(value)
        assert display in message and "\n" not in message and len(message) < 2000, message[:3000]
    return "read" if kind == "ok" else "refused"


# -- running them --------------------------------------------------------------------------------------------------

TARGETS: dict[str, tuple[Any, Callable[[str, Any], str]]] = {
    "header": (safetensors_files(), lambda workdir, blob: check_header(blob)),
    "handoff": (st.tuples(state_dicts(), handoff_cases()), lambda workdir, case: check_handoff(workdir, *case)),
    "rank_files": (rank_file_cases(), check_rank_files),
    "pickles": (pickle_cases(), check_pickle),
}


def _peak_rss_mb() -> float:
    """The process's peak resident memory so far (the kernel's VmHWM), in MB."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) / 1024


def run(
    target: str,
    *,
    examples: int,
    derandomize: bool,
    seed: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, int]:
    """Run ``examples`` cases of ``target``; return the count of each outcome. A case that runs past
    ``CASE_TIMEOUT`` seconds dumps every thread's traceback and exits the process (code 70): a hang. A case that
    takes more than ``CASE_SECONDS`` or raises the process's peak RSS more than ``CASE_MEMORY_MB`` above its peak
    before the first case breaks a property."""
    strategy, check = TARGETS[target]
    counts: dict[str, int] = {}
    seconds = CASE_SECONDS.get(target, CASE_TIMEOUT)
    ceiling = _peak_rss_mb() + CASE_MEMORY_MB

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(strategy)
    def one(case: Any) -> None:
        workdir = tempfile.mkdtemp(prefix=f"stagesafe-fuzz-{target}-")
        faulthandler.dump_traceback_later(CASE_TIMEOUT, exit=True)
        try:
            if log is not None:
                log(repr(case)[:4000])
            started = time.perf_counter()
            outcome = check(workdir, case)
            took = time.perf_counter() - started
            assert took <= seconds, f"the case took {took:.1f} s, more than {seconds:g}"
            assert _peak_rss_mb() <= ceiling, f"the case took the process's peak RSS to {_peak_rss_mb():.0f} MB"
            counts[outcome] = counts.get(outcome, 0) + 1
        finally:
            faulthandler.cancel_dump_traceback_later()
            shutil.rmtree(workdir, ignore_errors=True)

    if seed is not None:
        one = __import__("hypothesis").seed(seed)(one)
    one()
    return counts
