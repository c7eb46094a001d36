"""Crafting hostile files as an attacker who knows the formats would, and watching what a reader opens.

Shared by the tests of the readers and by ``benchmarks/fuzz_hostile.py``: safetensors files with any header,
handoffs whose manifest is forged to match them (its checksum recomputed), FIFOs and symbolic links in place of
files, and an audit hook that records every file the process opens, so that a test can assert that nothing
outside a folder was opened, or swaps a file at the moment a reader opens it.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
INDEX, MANIFEST = "model.safetensors.index.json", "stagesafe.json"

__all__ = [
    "INDEX",
    "MANIFEST",
    "before_opening",
    "forge_manifest",
    "torch_save_pickle",
    "traced_peak",
    "opened_files",
    "outside",
    "replace_shard",
    "run_python",
    "safetensors_bytes",
    "write_zero_checkpoint",
]


def safetensors_bytes(header: Any = None, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    """A safetensors file: its 8-byte length, the header (``raw`` bytes, or ``header`` as JSON) padded to 8, then
    ``data``."""
    text = raw if raw is not None else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def forge_manifest(root: str, edit: Callable[[dict], None]) -> dict:
    """Change the manifest of the local handoff ``root`` with ``edit`` and make its checksum match again, as an
    attacker who read the format would; the index gets the same weight map."""
    from stagesafe.handoff.manifest import manifest_checksum

    path = os.path.join(root, MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    edit(manifest)
    manifest["checksum"] = manifest_checksum(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)
    with open(os.path.join(root, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": manifest["total_size"]}, "weight_map": manifest["weight_map"]}, f)
    return manifest


def replace_shard(root: str, data: bytes, tensors: Mapping[str, tuple[str, list[int]]] | None = None) -> str:
    """Make ``data`` the only shard of the local handoff ``root``, with a manifest forged to match it: its size
    and digest, and ``tensors`` (name -> (dtype, shape)) stored in it. Returns the shard's name."""
    with open(os.path.join(root, MANIFEST)) as f:
        (shard,) = json.load(f)["shards"]
    with open(os.path.join(root, shard), "wb") as f:
        f.write(data)

    from stagesafe.handoff.digest import hash_buffer
    from stagesafe.handoff.manifest import digest_of

    def edit(manifest: dict) -> None:
        manifest["shards"][shard] = {digest_of(manifest): hash_buffer(digest_of(manifest), data), "size": len(data)}
        if tensors is not None:
            manifest["tensors"] = {name: {"dtype": d, "shape": list(s)} for name, (d, s) in tensors.items()}
            manifest["weight_map"] = {name: shard for name in tensors}
            manifest["aliases"] = {}

    forge_manifest(root, edit)
    return shard


# -- DeepSpeed checkpoints, laid out as DeepSpeed does, without DeepSpeed ------------------------------------------


def write_zero_checkpoint(
    folder: str,
    params: Mapping[str, Any],
    *,
    stage: int = 3,
    world_size: int = 2,
    buffers: Mapping[str, Any] | None = None,
    tag: str = "global_step1",
    edit: Callable[[str, int, dict], None] | None = None,
) -> str:
    """Write a ZeRO checkpoint of fp32 ``params`` (and ``buffers``) at ``folder`` in DeepSpeed's layout: ``latest``
    naming ``tag``, and per rank an optimizer file with the rank's partition of the flat fp32 masters and model
    states (ZeRO-3: one per rank; ZeRO-1/2: ``mp_rank_00_model_states.pt``). ``edit(kind, rank, states)``
    (``kind`` "optim" or "model") may change what is saved, as an attacker would. Returns ``folder``."""
    import math
    from collections import OrderedDict

    import torch

    buffers = dict(buffers or {})
    tag_dir = os.path.join(folder, tag)
    os.makedirs(tag_dir, exist_ok=True)
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write(tag)
    shapes = OrderedDict((name, torch.Size(t.shape)) for name, t in params.items())
    values = [t.detach().reshape(-1).float() for t in params.values()]
    if stage == 3:  # each param split in world_size parts of ceil(numel / world_size), padded with zeros
        parts: list[list] = [[] for _ in range(world_size)]
        for v in values:
            part = math.ceil(v.numel() / world_size)
            padded = torch.cat([v, torch.zeros(part * world_size - v.numel())])
            for rank in range(world_size):
                parts[rank].append(padded[rank * part : (rank + 1) * part])
        flats = [torch.cat(p) if p else torch.empty(0) for p in parts]
    else:  # one group: every param in order, padded to a multiple of 2 * world_size, cut in world_size parts
        joined = torch.cat(values) if values else torch.empty(0)
        total = math.ceil(joined.numel() / (2 * world_size)) * 2 * world_size
        joined = torch.cat([joined, torch.zeros(total - joined.numel())])
        flats = list(joined.split(total // world_size)) if total else [torch.empty(0)] * world_size
    groups_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    module = OrderedDict((name, t.clone()) for name, t in buffers.items())
    if stage < 3:
        module.update((name, t.detach().clone()) for name, t in params.items())
    for rank in range(world_size):
        optim = {
            "optimizer_state_dict": {
                "zero_stage": stage,
                "partition_count": world_size if stage == 3 else [world_size],
                groups_key: [flats[rank].clone()],
                "exp_avg": [torch.zeros_like(flats[rank])],
            },
            "ds_version": "0.19.8",
        }
        if edit is not None:
            edit("optim", rank, optim)
        torch.save(optim, os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        if stage == 3 or rank == 0:
            model = {
                "module": OrderedDict(module),
                "buffer_names": list(buffers),
                "param_shapes": [OrderedDict(shapes)],
                "frozen_param_shapes": None,
                "shared_params": {},
                "ds_version": "0.19.8",
                "global_steps": 1,
            }
            if edit is not None:
                edit("model", rank, model)
            name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
            torch.save(model, os.path.join(tag_dir, name))
    return folder


# -- what the process opens ------------------------------------------------------------------------------------------

_recorders: list[tuple[Callable[[str, tuple], str | None], list[str]]] = []
_lock = threading.Lock()
_hooked = False


def _hook(event: str, args: tuple) -> None:
    if _recorders:
        with _lock:
            for keep, into in _recorders:
                kept = keep(event, args)
                if kept is not None:
                    into.append(kept)


@contextlib.contextmanager
def _recording(keep: Callable[[str, tuple], str | None]) -> Iterator[list[str]]:
    """What ``keep`` makes of each audit event raised while the block runs (``None``: nothing). One audit hook
    serves every recorder: a hook cannot be removed."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_hook)
        _hooked = True
    found: list[str] = []
    with _lock:
        _recorders.append((keep, found))
    try:
        yield found
    finally:
        with _lock:
            _recorders.remove((keep, found))


def _opened_path(event: str, args: tuple) -> str | None:
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        return os.fsdecode(args[0])
    return None


def opened_files() -> contextlib.AbstractContextManager[list[str]]:
    """Record the path of every file opened (``open``, ``os.open``, ``io.open``) while the block runs."""
    return _recording(_opened_path)


def audit_events() -> contextlib.AbstractContextManager[list[str]]:
    """Record every audit event the process raises while the block runs (``os.system``, ``exec``, ``import``,
    ``open``, ``subprocess.Popen``, ...): what running code a file names would show."""
    return _recording(lambda event, args: event)



_swaps: list[list] = []  # [path, action, times left]: see before_opening
_swapping = threading.local()
_swap_hooked = False


def _swap(event: str, args: tuple) -> None:
    if not _swaps or getattr(_swapping, "on", False):
        return
    path = _opened_path(event, args)
    for entry in list(_swaps):
        if path == entry[0] and entry[2] > 0:
            entry[2] -= 1
            _swapping.on = True  # what the action does raises audit events of its own
            try:
                entry[1]()
            finally:
                _swapping.on = False


@contextlib.contextmanager
def before_opening(path: str, action: Callable[[], None], *, times: int = 1) -> Iterator[list]:
    """Run ``action`` when the process asks to open ``path`` (the exact string it passes), before the open
    happens, ``times`` times at most while the block runs: a file swapped between a reader's check and its
    open, at that moment every time instead of by chance. Yields ``[path, action, times left]``."""
    global _swap_hooked
    if not _swap_hooked:
        sys.addaudithook(_swap)
        _swap_hooked = True
    entry = [path, action, times]
    _swaps.append(entry)
    try:
        yield entry
    finally:
        _swaps.remove(entry)


def outside(paths: list[str], folder: str) -> list[str]:
    """The paths, symbolic links followed, that do not lie inside ``folder``."""
    real = os.path.realpath(folder)
    return [p for p in paths if os.path.commonpath([real, os.path.realpath(p)]) != real]


# -- a reader in a process of its own ----------------------------------------------------------------------------


def run_python(
    code: str,
    *args: str,
    timeout: float = 120,
    memory: int | None = None,
    file_size: int | None = None,
) -> subprocess.CompletedProcess:
    """Run ``code`` (with ``args`` as ``sys.argv[1:]``) in a fresh interpreter that imports this checkout, with a
    timeout: a reader that crashes (SIGSEGV, SIGBUS), hangs or eats memory fails the test instead of taking
    pytest down with it. ``memory`` caps its address space, ``file_size`` the files it writes (RLIMIT_FSIZE;
    Python ignores SIGXFSZ, so a write past it fails with EFBIG)."""
    import resource

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, HERE]))

    def limits() -> None:
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        if file_size is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        preexec_fn=limits,
    )


# -- files crafted to exhaust a reader's time or memory --------------------------------------------------------------


def torch_save_pickle(obj: Any) -> bytes:
    """The pickle ``torch.save`` writes for ``obj`` (its archive's data.pkl), to craft from or read alone."""
    import io
    import zipfile

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(buffer) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


@contextlib.contextmanager
def traced_peak() -> Iterator[list[int]]:
    """The peak of the memory Python allocated while the block ran (tracemalloc), appended to the list yielded."""
    import tracemalloc

    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def _text(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def _long(value: int) -> bytes:
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _in_optimizer_state(body: bytes) -> bytes:
    """A protocol-2 pickle of ``{"optimizer_state_dict": {"zero_stage": <body>, "partition_count": 1}}``: where a
    rank file's first check shows the value in its error message."""
    head = b"\x80\x02}(" + _text("optimizer_state_dict") + b"}(" + _text("partition_count") + b"K\x01"
    return head + _text("zero_stage") + body + b"uu."


def loss_scaler_levels(levels: int = 60) -> bytes:
    """``levels`` allow-listed LossScaler stand-ins, each with two attributes that are the level below: 2 ** levels
    paths through 8 kB (a repr bounded per level took time doubling with each level)."""
    body = b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\nq\x00)\x81}b"  # memo 0: the class; level 0
    for level in range(1, levels + 1):
        below = b"h" + bytes([level])  # the level below, kept in memo slot ``level``
        body += b"q" + bytes([level]) + b"0" + b"h\x00)\x81}(" + _text("a") + below + _text("b") + below + b"ub"
    return _in_optimizer_state(body)


def colliding_int_keys(count: int = 200_000) -> bytes:
    """A dict of ``count`` distinct int keys that all hash to 0 (multiples of 2**61 - 1): quadratic to fill."""
    items = [_long((k + 1) * (2**61 - 1)) + b"N" for k in range(count)]
    batches = [b"(" + b"".join(items[start : start + 1000]) + b"u" for start in range(0, count, 1000)]
    return _in_optimizer_state(b"}" + b"".join(batches))


def set_calls_of_a_big_list(items: int = 1_000_000, calls: int = 3000) -> bytes:
    """A list of ``items`` items, then ``calls`` calls of the allowed ``builtins.set`` on it (one memo read each)."""
    body = b"](" + b"N" * items + b"eq\x000" + b"c__builtin__\nset\nq\x010("
    body += b"h\x01h\x00\x85R" * calls + b"t"
    return _in_optimizer_state(body)


def byte_copies(size: int = 2**20, copies: int = 4000, how: str = "bytearray") -> bytes:
    """``size`` bytes, then ``copies`` copies of them by the allowed ``bytearray`` or ``_codecs.encode``."""
    if how == "bytearray":
        body = b"B" + struct.pack("<I", size) + b"\0" * size + b"q\x000c__builtin__\nbytearray\nq\x010("
        body += b"h\x01h\x00\x85R" * copies
    else:
        body = b"X" + struct.pack("<I", size) + b"a" * size + b"q\x000c_codecs\nencode\nq\x010" + _text("latin1")
        body += b"q\x020(" + b"h\x01h\x00h\x02\x86R" * copies
    return _in_optimizer_state(body + b"t")


def empty_sets(size: int = 10 * 2**20) -> bytes:
    """``size`` EMPTY_SET opcodes: 216 bytes of memory each."""
    return b"\x80\x04" + b"\x8f" * size + b"."


def _numpy_dtype(name: str, state: bytes) -> bytes:
    """``numpy.dtype(name, False, True)`` and its BUILD with the pickled ``state`` (the tuple's items)."""
    return b"cnumpy\ndtype\n" + _text(name) + b"\x89\x88\x87R(K\x03" + state + b"tb"


def _numpy_array(shape: int, dtype: bytes, raw: bytes) -> bytes:
    """numpy's ``_reconstruct`` of a 1-d array of ``shape`` items and its BUILD: ``dtype`` and ``raw`` are opcodes
    pushing them (a memo read each, to share one buffer)."""
    head = b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85C\x01b\x87R"
    return head + b"(K\x01" + _long(shape) + b"\x85" + dtype + b"\x89" + raw + b"tb"


def arrays_of_one_buffer(size: int = 2**20, arrays: int = 1500) -> bytes:
    """One ``size``-byte buffer in the memo, then ``arrays`` numpy arrays built from it (a 5-byte memo read each):
    a reader that copies the buffer per array allocates ``arrays`` times ``size``."""
    buffer = b"B" + struct.pack("<I", size) + b"\0" * size + b"q\x000"
    dtype = _numpy_dtype("u1", _text("|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00") + b"q\x010"
    items = _numpy_array(size, b"h\x01", b"h\x00") * arrays
    return _in_optimizer_state(buffer + dtype + b"](" + items + b"e")


def shared_build_state(names: int = 50_000, objects: int = 400, target: str = "stand-in") -> bytes:
    """One state of ``names`` attributes, ``(None, {name: None, ...})`` as an object with ``__slots__`` pickles it,
    in the memo, then ``objects`` objects each given it by a ``BUILD`` (a memo read): ``target`` a class outside
    the tables ("stand-in"), ``argparse.Namespace``, an ``OrderedDict`` or an allow-listed DeepSpeed class."""
    attributes = b"}(" + b"".join(_text(f"a{i}") + b"N" for i in range(names)) + b"u"
    state = b"N" + attributes + b"\x86q\x000"
    new = {
        "stand-in": b"cuser_project.config\nConfig\n)\x81",
        "namespace": b"cargparse\nNamespace\n)R",
        "ordered_dict": b"ccollections\nOrderedDict\n)R",
        "known": b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n)\x81",
    }[target]
    return _in_optimizer_state(state + b"](" + (new + b"h\x00b") * objects + b"e")


def zero_size_items(count: int = 2**33) -> bytes:
    """A numpy array of ``count`` items of the zero-byte dtype ``U0``, from no bytes: a size check of elements
    times item size passes it."""
    dtype = _numpy_dtype("U0", _text("<") + b"NNNK\x00K\x04K\x08")
    return _in_optimizer_state(_numpy_array(count, dtype, b"C\x00"))


HOSTILE_PICKLES: dict[str, Callable[[], bytes]] = {
    "loss_scaler_levels": loss_scaler_levels,
    "colliding_int_keys": colliding_int_keys,
    "set_calls_of_a_big_list": set_calls_of_a_big_list,
    "bytearray_copies": lambda: byte_copies(how="bytearray"),
    "encode_copies": lambda: byte_copies(how="encode"),
    "empty_sets": empty_sets,
    "arrays_of_one_buffer": arrays_of_one_buffer,
    **{f"shared_build_state_{target}": (lambda target=target: shared_build_state(target=target))
       for target in ("stand-in", "namespace", "ordered_dict", "known")},
    "zero_size_items": zero_size_items,
}


def write_zip(path: str, records: list[tuple[str, bytes, int, int, int]]) -> None:
    """A zip archive of ``records``, each ``(name, bytes as stored, method, declared size, declared CRC)``: any
    size or CRC an attacker declares, names given twice."""
    out, central = bytearray(), bytearray()
    for name, stored, method, size, crc in records:
        encoded = name.encode()
        fields = struct.pack("<HHHHHIIIHH", 20, 0, method, 0, 0x21, crc, len(stored), size, len(encoded), 0)
        where = struct.pack("<HHHII", 0, 0, 0, 0, len(out))  # no comment, disk 0, no attributes, the offset
        central += b"PK\x01\x02" + struct.pack("<H", 20) + fields + where + encoded
        out += b"PK\x03\x04" + fields + encoded + stored
    end = struct.pack("<HHHHIIH", 0, 0, len(records), len(records), len(central), len(out), 0)
    with open(path, "wb") as f:
        f.write(bytes(out) + bytes(central) + b"PK\x05\x06" + end)


def rewrite_rank_file(path: str, change: Callable[[list[tuple[str, bytes, int, int, int]]], None]) -> None:
    """Rewrite the torch.save archive ``path`` after ``change`` edits its records (stored, as torch writes them)."""
    import zipfile
    import zlib

    with zipfile.ZipFile(path) as archive:
        records = [(i.filename, archive.read(i), zipfile.ZIP_STORED) for i in archive.infolist()]
    records = [(name, data, method, len(data), zlib.crc32(data)) for name, data, method in records]
    change(records)
    write_zip(path, records)


def deflated_zeros(size: int) -> bytes:
    """A raw deflate stream of ``size`` zero bytes (a multiple of 1 MiB), built from one repeated block in
    milliseconds: about 1 kB per MiB."""
    import zlib

    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = compressor.compress(bytes(2**20)) + compressor.flush(zlib.Z_FULL_FLUSH)  # the state reset: repeatable
    return block * (size // 2**20) + compressor.flush()


def byteorder_bomb(path: str, inflated: int = 2**31) -> None:
    """Make the rank file ``path``'s ``byteorder`` record a deflate stream of ``inflated`` zero bytes that declares
    6 bytes, the CRC of ``little``."""
    import zlib

    def change(records: list) -> None:
        for i, (name, *_rest) in enumerate(records):
            if name.endswith("/byteorder"):
                records[i] = (name, deflated_zeros(inflated), 8, 6, zlib.crc32(b"little"))

    rewrite_rank_file(path, change)


def duplicate_pickle(path: str, other: bytes) -> None:
    """Give the rank file ``path`` a second ``data.pkl`` record, ``other``, after the first."""
    import zlib

    def change(records: list) -> None:
        name = next(r[0] for r in records if r[0].endswith("/data.pkl"))
        records.append((name, other, 0, len(other), zlib.crc32(other)))

    rewrite_rank_file(path, change)


def replace_pickle(path: str, data: bytes) -> None:
    """Make ``data`` the pickle of the rank file ``path`` (its CRC and sizes updated)."""
    import zlib

    def change(records: list) -> None:
        for i, (name, *_rest) in enumerate(records):
            if name.endswith("/data.pkl"):
                records[i] = (name, data, 0, len(data), zlib.crc32(data))

    rewrite_rank_file(path, change)


# name -> how it damages a rank file: the crafted files, each in a checkpoint of DeepSpeed's layout.
HOSTILE_RANK_FILES: dict[str, Callable[[str], None]] = {
    **{name: (lambda path, build=build: replace_pickle(path, build())) for name, build in HOSTILE_PICKLES.items()},
    "byteorder_2GiB_declared_6_bytes": byteorder_bomb,
    "two_data_pkl_records": lambda path: duplicate_pickle(path, b"\x80\x02}."),
}


def consolidate_measured(src: str, dst: str, timeout: float = 120) -> tuple[int, float, float, str]:
    """``stagesafe consolidate src dst`` in a fresh interpreter: :func:`cli_measured`."""
    return cli_measured(["consolidate", src, dst, "-q"], timeout=timeout)


def cli_measured(argv: list[str], timeout: float = 120) -> tuple[int, float, float, str]:
    """``stagesafe <argv>`` in a fresh interpreter: ``(exit code, seconds in main(), peak RSS in MB of the process,
    stderr)``. The peak is the kernel's VmHWM: ``ru_maxrss`` of a child counts the parent it was forked from."""
    code = (
        "import re, sys, time\n"
        "from stagesafe.cli import main\n"
        "start = time.perf_counter()\n"
        "code = main(sys.argv[1:])\n"
        "seconds = time.perf_counter() - start\n"
        "peak = int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) / 1024\n"
        "print('MEASURED', code, seconds, peak)\n"
    )
    result = run_python(code, *argv, timeout=timeout)
    line = next((line for line in result.stdout.splitlines() if line.startswith("MEASURED ")), None)
    if line is None:
        raise AssertionError(f"stagesafe {argv[0]} died: exit {result.returncode}, stderr {result.stderr[-3000:]}")
    _, exit_code, seconds, rss = line.split()
    return int(exit_code), float(seconds), float(rss), result.stderr
