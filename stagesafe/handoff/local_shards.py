"""Reading local shard files fast: mapped as ``load_file`` maps them, and hashed through the mapping first.

A shard's digest is checked before its tensors are trusted. ``safetensors.torch.load_file`` only maps the file;
reading it into memory of our own would cost a copy that takes longer than the hash itself. So a shard is
mapped, its bytes hashed through the mapping on every core (:mod:`stagesafe.handoff.digest`), and its tensors
are views of the mapping, as with ``load_file``. A file whose bytes this process has already hashed (it wrote
them, or loaded them) is mapped without hashing it again, as long as it is still the same file: same inode,
size, modification and change times.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import IO, TYPE_CHECKING

from stagesafe.handoff import codec
from stagesafe.handoff import digest as _digest

if TYPE_CHECKING:
    import torch

__all__ = ["map_hashed", "map_file", "remember", "known", "tensors_in"]

_lock = threading.Lock()
# path -> (identity, (digest name, hex digest of its bytes))
_KNOWN: dict[str, tuple[tuple[int, int, int, int, int], tuple[str, str]]] = {}


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _stat(path: str, f: IO[bytes] | None) -> os.stat_result:
    return os.fstat(f.fileno()) if f is not None else os.stat(path)


def remember(path: str, digest: str, hexdigest: str, *, f: IO[bytes] | None = None) -> None:
    """This process knows the bytes of ``path`` (read through ``f``, if given) have the ``digest`` (a name of
    :mod:`stagesafe.handoff.digest`) ``hexdigest``: it wrote or verified them just now."""
    try:
        identity = _identity(_stat(path, f))
    except OSError:
        return
    with _lock:
        _KNOWN[path] = (identity, (digest, hexdigest))


def known(path: str, digest: str, hexdigest: str, *, f: IO[bytes] | None = None) -> bool:
    """True when ``path`` (the file open as ``f``, if given) is the very file this process found to have the
    ``digest`` ``hexdigest``, unchanged since."""
    with _lock:
        entry = _KNOWN.get(path)
    if entry is None or entry[1] != (digest, hexdigest):
        return False
    try:
        return _identity(_stat(path, f)) == entry[0]
    except OSError:
        return False


def map_hashed(f: IO[bytes], size: int, digest: str) -> tuple[torch.Tensor, str]:
    """The first ``size`` bytes of the open local file ``f``, mapped (:func:`map_file`), and their ``digest``,
    hashed through the mapping on as many threads as help. Hashing touches every page, so the tensors' reads
    later find them mapped: the hash takes the place of the page faults ``load_file``'s reader pays."""
    buffer = map_file(f, size, read_now=True)
    return buffer, _digest.hash_buffer(digest, memoryview(buffer.numpy()))


def map_file(f: IO[bytes], size: int, *, read_now: bool = False) -> torch.Tensor:
    """The first ``size`` bytes of the open local file ``f`` mapped copy-on-write, read lazily where touched
    (what ``load_file`` does), in order: a page not cached yet comes with a full read-ahead window, not the
    small read-around of a random fault. ``read_now``: every byte is about to be read (hashed): the kernel is
    asked to start reading the whole file at once."""
    import torch

    if not size:
        return torch.empty(0, dtype=torch.uint8)
    mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with contextlib.suppress(AttributeError, OSError):  # advice: only speed is at stake
        mapped.madvise(mmap.MADV_SEQUENTIAL)
        if read_now:
            mapped.madvise(mmap.MADV_WILLNEED)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # the tensor keeps the mapping alive


def tensors_in(buffer: torch.Tensor, *, source: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``buffer`` (uint8), each over its own bytes of it: no copy. The
    header is checked in full first (:func:`stagesafe.handoff.codec.parse_header`); ``source`` names the file in
    errors. Each tensor has a storage of its own, as ``load_file``'s have: views of one storage in several dtypes
    are refused by ``torch.save`` ("Cannot save multiple tensors or storages that view the same data as different
    types"), and a storage the size of the shard would be saved whole with any one of its tensors."""
    import torch

    size = buffer.numel()
    prefix = buffer[:8].numpy().tobytes()
    length = codec.header_length(prefix, size, source=source)
    header = codec.parse_header(buffer[: 8 + length].numpy().tobytes(), size, source=source)
    whole = memoryview(buffer.numpy())  # keeps ``buffer``, and so the mapping, alive
    tensors = {}
    for entry in header.tensors:
        dtype = getattr(torch, entry.dtype)
        start, nbytes = header.data_start + entry.begin, entry.end - entry.begin
        if not nbytes:
            flat = torch.empty(0, dtype=dtype)
        elif start % dtype.itemsize:  # misaligned for its dtype: a copy of its own
            flat = buffer[start : start + nbytes].clone().view(dtype)
        else:
            flat = torch.frombuffer(whole, dtype=dtype, count=nbytes // dtype.itemsize, offset=start)
        tensors[entry.name] = flat.reshape(entry.shape)
    return tensors
