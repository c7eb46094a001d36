"""The examples run as users run them (Lightning spawns rank 1 itself) and print what the README promises."""

from __future__ import annotations

import os

import pytest
from _launch import run_script

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.mark.timeout(300)
def test_stage_sequence_demo(tmp_path):
    result = run_script(
        os.path.join(EXAMPLES, "stage_sequence.py"), ["--handoff-uri", str(tmp_path / "handoff")], timeout=240
    )
    rows = {}
    for line in result.stdout.splitlines():
        cells = line.split()
        if cells and cells[0] in ("validate", "fit", "test", "predict"):
            rows[cells[0]] = cells  # stage, enter s, leave s, handoff MB, written, clean, numel, x, dtype
    assert list(rows) == ["validate", "fit", "test", "predict"]
    for stage, cells in rows.items():
        assert cells[4] == ("yes" if stage == "fit" else "no")  # only training changes the weights
        assert cells[5] == "yes"  # the clean check passed
        assert cells[6:] == ["4096", "x", "torch.float32"]  # real weights in the original dtype
    assert "module.state_dict() == handoff, bitwise: True" in result.stdout
