"""Reading local shard files fast: read once and hashed as the bytes arrive, or mapped when already known.

A shard's sha256 is checked before its tensors are trusted. Hashing costs one pass over the bytes at about
1.8 GB/s per core, while ``safetensors.torch.load_file`` only maps the file. So a file is hashed while it is
read (one copy, hashed while still in cache), and a file whose bytes this process has already hashed (it
wrote them, or verified them) is mapped like ``load_file`` does, as long as it is still the same file: same
inode, size, modification and change times. Tensors are views of the shard's buffer, as with ``load_file``.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from typing import IO, TYPE_CHECKING

from stagesafe.handoff import codec

if TYPE_CHECKING:
    import torch

__all__ = ["CHUNK", "read_hashed", "map_file", "remember", "known", "tensors_in"]

CHUNK = 16 * 1024 * 1024  # read and hash in pieces of this size

_lock = threading.Lock()
_KNOWN: dict[str, tuple[tuple[int, int, int, int, int], str]] = {}  # path -> (identity, sha256 of its bytes)


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _stat(path: str, f: IO[bytes] | None) -> os.stat_result:
    return os.fstat(f.fileno()) if f is not None else os.stat(path)


def remember(path: str, sha256: str, *, f: IO[bytes] | None = None) -> None:
    """This process knows the bytes of ``path`` (read through ``f``, if given) hash to ``sha256`` (it wrote or
    verified them just now)."""
    try:
        identity = _identity(_stat(path, f))
    except OSError:
        return
    with _lock:
        _KNOWN[path] = (identity, sha256)


def known(path: str, sha256: str, *, f: IO[bytes] | None = None) -> bool:
    """True when ``path`` (the file open as ``f``, if given) is the very file this process hashed to ``sha256``,
    unchanged since."""
    with _lock:
        entry = _KNOWN.get(path)
    if entry is None or entry[1] != sha256:
        return False
    try:
        return _identity(_stat(path, f)) == entry[0]
    except OSError:
        return False


def read_hashed(f: IO[bytes], limit: int) -> tuple[torch.Tensor, str]:
    """At most ``limit + 1`` bytes of the open file ``f`` (one more than expected shows a file that grew), read
    once into one buffer and hashed chunk by chunk as they arrive, while still in cache."""
    import torch

    buffer = torch.empty(limit + 1, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    digest = hashlib.sha256()
    done = 0
    while done <= limit:
        n = f.readinto(view[done : min(done + CHUNK, limit + 1)])
        if not n:
            break
        digest.update(view[done : done + n])
        done += n
    return buffer[:done], digest.hexdigest()  # exactly the bytes hashed, whatever happens to the file meanwhile


def map_file(f: IO[bytes], size: int) -> torch.Tensor:
    """The first ``size`` bytes of the open local file ``f`` mapped copy-on-write, read lazily where touched
    (what ``load_file`` does)."""
    import torch

    if not size:
        return torch.empty(0, dtype=torch.uint8)
    mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # the tensor keeps the mapping alive


def tensors_in(buffer: torch.Tensor, *, source: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``buffer`` (uint8), as views of it: no copy. The header is
    checked in full first (:func:`stagesafe.handoff.codec.parse_header`); ``source`` names the file in errors."""
    import torch

    size = buffer.numel()
    prefix = buffer[:8].numpy().tobytes()
    length = codec.header_length(prefix, size, source=source)
    header = codec.parse_header(buffer[: 8 + length].numpy().tobytes(), size, source=source)
    tensors = {}
    for entry in header.tensors:
        dtype = getattr(torch, entry.dtype)
        raw = buffer[header.data_start + entry.begin : header.data_start + entry.end]
        if (header.data_start + entry.begin) % dtype.itemsize:  # misaligned for its dtype: a copy of its own
            raw = raw.clone()
        tensors[entry.name] = raw.view(dtype).reshape(entry.shape)
    return tensors
