"""Many small tensors' bytes gathered into one chunk, so that a shard of 20,000 tensors of 64 bytes costs the
writer a handful of writes and hashes instead of 20,000 of each, and no torch operation per tensor.

A plain tensor (or parameter) qualifies when its bytes already lie in host memory in the order the format stores them (on the CPU,
contiguous, no lazy conjugate or negative bit): they are copied straight from its address, and a run of them
is handed on as one ``bytes`` object. Any other tensor takes :mod:`~stagesafe.handoff.shards`' own path (moved,
made contiguous).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["SMALL", "SmallRun"]

SMALL = 1024 * 1024  # a tensor of fewer bytes joins the run; a larger one is written as it is
_RUN = 16 * 1024 * 1024  # bytes gathered before the run is handed to the file (and its hash)


class SmallRun:
    """The bytes of consecutive small tensors, each copied as it is added (so that a lazy mapping's tensor is
    dropped before the next is read), joined into one chunk by :meth:`take`."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self.nbytes = 0

    @staticmethod
    def takes(tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s stored bytes are its bytes in the format, small enough for a run. Subclasses
        (which may define their own ``contiguous``, ``to``) take the general path."""
        import torch

        return (
            type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and tensor.nbytes < SMALL
            and tensor.is_cpu
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
        )

    def add(self, tensor: torch.Tensor) -> bool:
        """Copy the bytes of a tensor :meth:`takes` accepted; return whether the run is now full enough to take."""
        size = tensor.nbytes
        if size:
            self._pieces.append(ctypes.string_at(tensor.data_ptr(), size))
            self.nbytes += size
        return self.nbytes >= _RUN

    def take(self) -> bytes:
        """The run's bytes as one chunk, and an empty run."""
        data = b"".join(self._pieces)
        self._pieces, self.nbytes = [], 0
        return data
