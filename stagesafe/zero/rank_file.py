"""One DeepSpeed rank file, read safely: its structure on the meta device, the bytes of its tensors with ``pread``.

A rank file holds far more than the weights (the Adam moments take twice their size), so it is not read whole.
It is not memory-mapped either: a trainer that saves the same tag again truncates the file in place, and
touching a mapped page past its new end kills the reader with SIGBUS. Instead the file is opened once (a
regular file inside its folder), its pickle is loaded by the safe unpickler on the meta device (no tensor data
read, nothing allocated for it), and every tensor that is to be read is checked against the file itself: its
storage must be one stored record of the zip archive, within the file's real size, and the tensor a run of that
storage (a stride-0 view that repeats 4 bytes 16 million times is refused). Only then are its bytes read, with
``pread``, into memory the caller allocated for exactly them; a file that shrank meanwhile gives a short read
and a clear error.
"""

from __future__ import annotations

import os
import struct
import sys
import zipfile
from typing import Any

import torch

from stagesafe.errors import CheckpointFormatError, clip, shown
from stagesafe.handoff.safe_files import open_local
from stagesafe.zero.safe_pickle import safe_load

__all__ = ["RankFile"]

_ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip local file header: signature ... name length, extra length
_MAX_BYTEORDER = 16


class RankFile:
    """A rank file opened once. ``content`` is its unpickled structure, every tensor on the meta device;
    :meth:`check` a tensor of it before :meth:`read_into` or :meth:`materialize` read its bytes."""

    def __init__(self, folder: str, name: str, *, display: str):
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
            self._records = self._stored_records()
            self._materialized: dict[int | None, torch.Tensor] = {}  # storage offset -> its bytes, read once
            self._materialized_bytes = 0
            self._file.seek(0)
            self.content = safe_load(self._file, meta=True, display_name=display)
        except BaseException:
            self._file.close()
            raise

    def close(self) -> None:
        self._file.close()

    def check(self, tensor: Any, what: str, *, contiguous: bool = True) -> torch.Tensor:
        """``tensor`` if its bytes lie in this file as ``torch.save`` lays them out, else a
        ``CheckpointFormatError`` naming ``what``. ``contiguous``: its elements are one run of bytes."""
        if not isinstance(tensor, torch.Tensor):
            raise self._bad(f"{what} is {shown(tensor, 80)}, not a tensor")
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type != "meta":
            raise self._bad(f"{what} is a {tensor.layout} {tensor.dtype} tensor, not one torch.save stores as bytes")
        if tensor.numel() == 0:
            return tensor
        if contiguous and not tensor.is_contiguous():
            raise self._bad(
                f"{what} is a view of shape {list(tensor.shape)[:8]} with strides {list(tensor.stride())[:8]}, not "
                "one run of bytes (a stride 0 repeats the same bytes); DeepSpeed saves contiguous tensors"
            )
        storage = tensor.untyped_storage()
        start = getattr(storage, "_checkpoint_offset", None)
        record = self._records.get(start) if type(start) is int else None
        end = (tensor.storage_offset() + _span(tensor)) * tensor.element_size()
        if record is None or storage.nbytes() > record or end > storage.nbytes():
            raise self._bad(
                f"{what} claims {end} bytes of a storage of {storage.nbytes()} that is not a record of the file "
                f"({self.size} bytes); the file was crafted or damaged"
            )
        return tensor

    def read_into(self, tensor: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of the checked contiguous ``tensor`` into ``out``, a contiguous
        tensor of its dtype."""
        if start < 0 or start + out.numel() > tensor.numel() or out.dtype != tensor.dtype:  # pragma: no cover
            raise AssertionError(f"read of {out.numel()} {out.dtype} at {start} of {tensor.numel()} {tensor.dtype}")
        itemsize = tensor.element_size()
        offset = tensor.untyped_storage()._checkpoint_offset + (tensor.storage_offset() + start) * itemsize
        self._pread(out, offset)

    def materialize(self, tensor: torch.Tensor) -> torch.Tensor:
        """A checked tensor of any strides as ``torch.load`` gives it: a view of its whole storage, read once and
        shared by every tensor of this file that views it. All the storages read this way together may not
        hold more bytes than the file does."""
        storage = tensor.untyped_storage()
        start = storage._checkpoint_offset if tensor.numel() else None
        if start not in self._materialized:
            nbytes = storage.nbytes() if start is not None else 0
            if self._materialized_bytes + nbytes > self.size:
                raise self._bad(f"its tensors claim more bytes than the file holds ({self.size})")
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                self._pread(buffer, start)
            self._materialized[start] = buffer
            self._materialized_bytes += nbytes
        out = torch.empty(0, dtype=tensor.dtype)
        return out.set_(self._materialized[start].untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())

    # -- internals ----------------------------------------------------------------------------------------------

    def _bad(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.display}: {what}")

    def _pread(self, out: torch.Tensor, offset: int) -> None:
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointFormatError(
                    f"{self.display} ends at byte {offset + done} (it is {os.fstat(self._fd).st_size} bytes now, "
                    f"{self.size} when opened): it shrank while being read. Was the checkpoint being saved again? "
                    "Read it once the save is done"
                )
            done += n

    def _stored_records(self) -> dict[int, int]:
        """``{file offset of a stored (uncompressed) record's bytes: its size}``, from the zip directory and each
        record's own header, keeping those that lie within the file; and the byte order torch saved with."""
        try:
            with zipfile.ZipFile(self._file) as archive:
                infos = archive.infolist()
                order = [i for i in infos if i.filename.rpartition("/")[2] == "byteorder"]
                byteorder = archive.read(order[0]) if order and order[0].file_size <= _MAX_BYTEORDER else b"little"
        except Exception as exc:  # noqa: BLE001 - zipfile raises many kinds on a crafted archive
            raise CheckpointFormatError(
                f"{self.display} cannot be read as a torch checkpoint file, its zip directory is broken "
                f"({type(exc).__name__}: {clip(str(exc), 120)}); it is damaged or truncated: was it written or "
                "copied completely?"
            ) from None
        if byteorder.decode("ascii", "replace") != sys.byteorder:
            raise self._bad(
                f"it was saved in {shown(byteorder.decode('ascii', 'replace'), 40)} byte order, this machine is "
                f"{sys.byteorder}; consolidate it on a machine of its byte order"
            )
        records: dict[int, int] = {}
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                continue
            local = os.pread(self._fd, _LOCAL_HEADER.size, info.header_offset)
            if len(local) < _LOCAL_HEADER.size:
                continue
            signature, name_length, extra_length = _LOCAL_HEADER.unpack(local)
            start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            if signature == _ZIP_MAGIC and start + info.file_size <= self.size:
                records[start] = info.file_size
        return records


def _span(tensor: torch.Tensor) -> int:
    """Elements of its storage that a non-empty tensor reaches, from its first: 1 + the sum of (size - 1) * stride."""
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
