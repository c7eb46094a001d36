"""zero/engine/checkpoint_state.py: the files DeepSpeed's ``save_checkpoint`` would write for this rank, read off
a live 1-rank ZeRO-3 engine without writing: the same file names, and every tensor in them found."""

from __future__ import annotations

import os

import pytest
import torch
from _engine_nets import net, step
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.zero.engine.checkpoint_state import checkpoint_files, tensors_in

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


def test_the_files_are_those_deepspeed_writes(build, tmp_path):  # noqa: F811
    engine = build(net())
    step(engine)
    files = checkpoint_files(engine, exclude_frozen=False)
    engine.save_checkpoint(str(tmp_path), tag="saved")
    assert files is not None and sorted(files) == sorted(os.listdir(tmp_path / "saved"))


def test_every_tensor_in_nested_dicts_lists_and_tuples_is_found():
    a, b, c = torch.ones(1), torch.zeros(2), torch.arange(3)
    found = list(tensors_in({"x": [a, (b, {"y": c})], "n": 3, "s": "text"}))
    assert [t is u for t, u in zip(found, [a, b, c])] == [True, True, True] and len(found) == 3
