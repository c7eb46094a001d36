"""One DeepSpeed rank file, read safely: its pickle by :mod:`stagesafe.zero.pickle_reader`, the bytes of its
tensors with ``pread``, no torch needed.

A rank file is the zip archive ``torch.save`` writes: ``<name>/data.pkl`` (the structure) and one stored record
``<name>/data/<key>`` per tensor storage. It holds far more than the weights (the Adam moments take twice their
size), so it is not read whole. It is not memory-mapped either: a trainer that saves the same tag again
truncates the file in place, and touching a mapped page past its new end kills the reader with SIGBUS. Instead
the file is opened once (a regular file inside its folder), its pickle is interpreted without running anything
it names (tensors come out as :class:`~stagesafe.zero.pickle_globals.TensorRecord`, nothing read), and every
tensor that is to be read is checked against the file itself: its storage must be the stored record of its key,
within the file's real size, and the tensor a run of that storage (a stride-0 view that repeats 4 bytes 16
million times is refused). Only then are its bytes read, with ``pread``, into memory the caller allocated for
exactly them; a file that shrank meanwhile gives a short read and a clear error.

Every record of the archive is read with a limit from what it can be: ``byteorder`` a few bytes (a record that
inflates past them is refused after at most a few kilobytes, however large it claims or inflates to), the
pickle and the storages their stored size, within the file; the others (``version``, ``.data/...``) are not
read. Two records of one name are refused: readers disagree on which one counts (torch takes the last).
"""

from __future__ import annotations

import os
import struct
import sys
import zipfile
import zlib
from typing import Any

from stagesafe.errors import CheckpointFormatError, clip, shown
from stagesafe.storage.safe_files import open_local
from stagesafe.zero.pickle_globals import TensorRecord
from stagesafe.zero.pickle_reader import read_pickle

__all__ = ["RankFile"]

_ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip local file header: signature ... name length, extra length
_MAX_BYTEORDER = 16


def _named_twice(infos: list[zipfile.ZipInfo]) -> str | None:
    """The first name two records of the archive share, if any."""
    seen: set[str] = set()
    for info in infos:
        if info.filename in seen:
            return info.filename
        seen.add(info.filename)
    return None


def _read_small(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes | None:
    """The record ``info`` if it holds at most ``limit`` bytes, its size as declared, else None; never more than a
    few kilobytes are inflated, whatever the record claims."""
    if info.file_size > limit or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        return None
    with archive.open(info) as record:
        data = record.read(limit + 1)  # zipfile inflates at most 4 KiB to give these
    return data if len(data) == info.file_size else None


class RankFile:
    """A rank file opened once. ``content`` is its pickled structure, tensors as records; :meth:`check` a tensor
    of it before :meth:`read_into` or :meth:`materialize` read its bytes."""

    def __init__(self, folder: str, name: str, *, display: str, trusted: bool = False):
        self.display = display
        self._file = open_local(folder, name, error=CheckpointFormatError, what=display)
        try:
            self._fd = self._file.fileno()
            self.size = os.fstat(self._fd).st_size
            if os.pread(self._fd, 4, 0) != _ZIP_MAGIC:
                raise CheckpointFormatError(
                    f"{display} is not a zip-format torch file (torch.save writes them since torch 1.6); it is "
                    "damaged, or not a DeepSpeed rank file: load and save it again with a recent torch"
                )
            pickled, self._storages = self._read_archive()
            self._materialized: dict[str | None, Any] = {}  # storage key -> its bytes (a torch tensor), read once
            self._materialized_bytes = 0
            self.content = read_pickle(pickled, display=display, trusted=trusted)
        except Exception:  # an interrupt needs no cleanup: the half-built object goes, its descriptor with it
            self._file.close()
            raise

    def close(self) -> None:
        self._file.close()

    def load_with_torch(self) -> Any:
        """The whole file as ``torch.load(weights_only=False)`` gives it, on the CPU: this runs code the file names.
        For a file its user trusts (``STAGESAFE_TRUST_PICKLES=1``)."""
        import torch

        with os.fdopen(os.dup(self._fd), "rb") as f:  # the same file, whatever its name points to now
            f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=False)

    def check(self, tensor: Any, what: str, *, contiguous: bool = True) -> TensorRecord:
        """``tensor`` if its bytes lie in this file as ``torch.save`` lays them out, else a
        ``CheckpointFormatError`` naming ``what``. ``contiguous``: its elements are one run of bytes."""
        if not isinstance(tensor, TensorRecord):
            raise self._bad(f"{what} is {shown(tensor, 80)}, not a tensor")
        if tensor.numel == 0:
            return tensor
        if contiguous and not tensor.is_contiguous():
            raise self._bad(
                f"{what} is a view of shape {list(tensor.shape)[:8]} with strides {list(tensor.stride)[:8]}, not "
                "one run of bytes (a stride 0 repeats the same bytes); DeepSpeed saves contiguous tensors"
            )
        storage = tensor.storage
        record = self._storages.get(storage.key)
        end = (tensor.offset + tensor.span()) * tensor.itemsize
        if record is None or storage.nbytes > record[1] or end > storage.nbytes:
            raise self._bad(
                f"{what} claims {end} bytes of a storage of {storage.nbytes} that is not a record of the file "
                f"({self.size} bytes); the file was crafted or damaged"
            )
        return tensor

    def read_into(self, tensor: TensorRecord, start: int, out: memoryview) -> None:
        """Elements ``[start, start + n)`` of the checked contiguous ``tensor`` into ``out``, a writable buffer of
        exactly ``n`` elements' bytes."""
        itemsize = tensor.itemsize
        if start < 0 or len(out) % itemsize or start + len(out) // itemsize > tensor.numel:  # pragma: no cover
            raise AssertionError(f"read of {len(out)} bytes at element {start} of {tensor!r}")
        self._pread(out, self._storages[tensor.storage.key][0] + (tensor.offset + start) * itemsize)

    def materialize(self, tensor: TensorRecord) -> Any:
        """A checked tensor of any strides as ``torch.load`` gives it (imports torch): a view of its whole storage,
        read once and shared by every tensor of this file that views it. All the storages read this way together
        may not hold more bytes than the file does."""
        import torch

        dtype = getattr(torch, tensor.dtype)
        if tensor.numel == 0:
            return torch.empty(tensor.shape, dtype=dtype)
        key = tensor.storage.key
        if key not in self._materialized:
            nbytes = tensor.storage.nbytes
            if self._materialized_bytes + nbytes > self.size:
                raise self._bad(f"its tensors claim more bytes than the file holds ({self.size})")
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            self._pread(memoryview(buffer.numpy()), self._storages[key][0])
            self._materialized[key] = buffer
            self._materialized_bytes += nbytes
        out = torch.empty(0, dtype=dtype)
        return out.set_(self._materialized[key].untyped_storage(), tensor.offset, tensor.shape, tensor.stride)

    # -- internals ----------------------------------------------------------------------------------------------

    def _bad(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.display}: {what}")

    def _pread(self, out: memoryview, offset: int) -> None:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        done = 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done:]], offset + done)
            if n <= 0:
                raise CheckpointFormatError(
                    f"{self.display} ends at byte {offset + done} (it is {os.fstat(self._fd).st_size} bytes now, "
                    f"{self.size} when opened): it shrank while being read. Was the checkpoint being saved again? "
                    "Read it once the save is done"
                )
            done += n

    def _read_archive(self) -> tuple[bytearray, dict[str, tuple[int, int]]]:
        """The pickle ``<name>/data.pkl`` and ``{storage key: (file offset of its record's bytes, size)}``, from the
        zip directory and each record's own header, keeping the stored (uncompressed) records that lie within the
        file, as ``torch.save`` writes them; and a check of the byte order torch saved with. The archive's name
        is its first record's folder, as torch's reader takes it."""
        try:
            with zipfile.ZipFile(self._file) as archive:
                infos = archive.infolist()
                prefix = infos[0].filename.partition("/")[0] + "/" if infos else ""
                twice = _named_twice(infos)
                order = [i for i in infos if i.filename == f"{prefix}byteorder"]
                byteorder = _read_small(archive, order[0], _MAX_BYTEORDER) if order and not twice else b"little"
        except Exception as exc:  # noqa: BLE001 - zipfile raises many kinds on a crafted archive
            raise CheckpointFormatError(
                f"{self.display} cannot be read as a torch checkpoint file, its zip directory is broken "
                f"({type(exc).__name__}: {clip(str(exc), 120)}); it is damaged or truncated: was it written or "
                "copied completely?"
            ) from None
        if twice is not None:
            raise self._bad(
                f"it holds two zip records named {shown(twice, 80)}, where torch.save writes one; readers disagree on "
                "which one counts (torch takes the last): the file was crafted or damaged"
            )
        if byteorder is None:
            raise self._bad(
                f"its record {prefix}byteorder holds more than the {_MAX_BYTEORDER} bytes a byte order takes (or "
                "inflates past the size it declares): the file was crafted or damaged"
            )
        if byteorder.decode("ascii", "replace") != sys.byteorder:
            raise self._bad(
                f"it was saved in {shown(byteorder.decode('ascii', 'replace'), 40)} byte order, this machine is "
                f"{sys.byteorder}; consolidate it on a machine of its byte order"
            )
        records: dict[str, tuple[int, int, int]] = {}  # name in the archive -> (start, size, CRC)
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.startswith(prefix):
                continue
            local = os.pread(self._fd, _LOCAL_HEADER.size, info.header_offset)
            if len(local) < _LOCAL_HEADER.size:
                continue
            signature, name_length, extra_length = _LOCAL_HEADER.unpack(local)
            start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            if signature == _ZIP_MAGIC and start + info.file_size <= self.size:
                records.setdefault(info.filename[len(prefix) :], (start, info.file_size, info.CRC))
        pickled = records.get("data.pkl")
        if pickled is None:
            raise self._bad(
                f"it holds no stored record {prefix}data.pkl within its {self.size} bytes, where torch.save writes "
                "the pickle; it is damaged, truncated or not a torch checkpoint file"
            )
        data = bytearray(pickled[1])
        self._pread(memoryview(data), pickled[0])
        if zlib.crc32(data) != pickled[2]:
            raise self._bad(f"its pickle {prefix}data.pkl fails its CRC check; the file is damaged")
        storages = {name[5:]: (start, size) for name, (start, size, _) in records.items() if name.startswith("data/")}
        return data, storages
