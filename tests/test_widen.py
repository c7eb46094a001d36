"""16-bit floats widened to fp32 without torch (stagesafe/zero/widen.py): every bit pattern, against torch's own
``.float()``, which is what DeepSpeed's reader applies to a 16-bit buffer."""

from __future__ import annotations

import pytest
import torch
from _hostile import run_python

from stagesafe.zero.widen import to_float32

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_16_bit_pattern_widens_to_torchs_bits(dtype):
    """All 65,536 values: zeros, subnormals, infinities and every NaN payload, quiet and signalling."""
    values = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(getattr(torch, dtype))
    ours = bytes(to_float32(values.view(torch.int16).numpy().tobytes(), dtype))
    assert ours == values.float().numpy().tobytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pieces_without_nan_need_no_torch(dtype):
    """A bf16 piece, and an fp16 piece holding no NaN, are widened by numpy alone; an fp16 NaN goes to torch."""
    code = (
        "import sys, struct\n"
        "from stagesafe.zero.widen import to_float32\n"
        "one = struct.pack('<H', 0x3F80 if sys.argv[1] == 'bfloat16' else 0x3C00)\n"
        "assert struct.unpack('<f', bytes(to_float32(one * 4, sys.argv[1])[:4]))[0] == 1.0\n"
        "print('torch' in sys.modules)\n"
        "to_float32(struct.pack('<H', 0x7E01), sys.argv[1])\n"
        "print('torch' in sys.modules)\n"
    )
    result = run_python(code, dtype)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "False" if dtype == "bfloat16" else "True"]


def test_an_empty_piece_is_empty():
    assert bytes(to_float32(b"", "bfloat16")) == b"" == bytes(to_float32(b"", "float16"))
