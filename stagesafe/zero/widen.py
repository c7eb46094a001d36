"""16-bit float buffers widened to fp32 as DeepSpeed's reader widens them (``tensor.float()``), without torch
where the result is fixed by the values alone.

A bfloat16 is the upper half of a float32: widening puts its 16 bits on top of 16 zero bits, which is what torch
does on every path, NaN payloads included. Every float16 but a NaN has exactly one float32 value, so any correct
conversion gives the same bits; a NaN's bits depend on the conversion (hardware F16C quiets a signalling NaN),
so a float16 piece holding one, and every other dtype, is widened by torch itself. numpy and torch are imported
only when a piece needs them.
"""

from __future__ import annotations

__all__ = ["to_float32"]


def to_float32(raw: bytes | bytearray | memoryview, dtype: str) -> memoryview:
    """The float32 bytes of the ``dtype`` values whose native-order bytes are ``raw``."""
    import numpy as np

    if dtype == "bfloat16":
        widened = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        return memoryview(widened).cast("B")
    if dtype == "float16":
        halves = np.frombuffer(raw, dtype=np.float16)
        if not np.isnan(halves).any():
            return memoryview(halves.astype(np.float32)).cast("B")
    import torch

    values = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)) if len(raw) else torch.empty(0)
    return memoryview(values.float().numpy()).cast("B")
