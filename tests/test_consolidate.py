"""consolidate.py: a DeepSpeed checkpoint folder (a real 1-rank ZeRO-3 engine's, written in the test process)
written as a handoff whose weights are the engine's fp32 masters bit for bit; a destination that holds a
handoff is refused unless asked to replace it; ``inspect_checkpoint`` describes both without tensor data."""

from __future__ import annotations

import pytest
import torch
from _engine_nets import net, step
from _tensors import assert_bitwise_equal
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.consolidate import consolidate, inspect_checkpoint, load_zero_checkpoint
from stagesafe.errors import HandoffExistsError
from stagesafe.handoff.read import load_state_dict

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


@pytest.fixture
def checkpoint(build, tmp_path):  # noqa: F811 - the fixture imported above
    model = net()
    engine = build(model)
    step(engine)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    masters = {n: deepspeed.utils.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    return str(tmp_path / "ckpt"), dict(sorted(masters.items()))


def test_the_handoff_holds_the_engines_fp32_masters_and_replaces_only_when_asked(checkpoint, tmp_path):
    src, masters = checkpoint
    dst = str(tmp_path / "handoff")
    consolidate(src, dst, max_shard_size="1KB")
    assert_bitwise_equal(dict(sorted(load_state_dict(dst).items())), masters)
    assert_bitwise_equal(dict(sorted(load_zero_checkpoint(src).items())), masters)
    with pytest.raises(HandoffExistsError):
        consolidate(src, dst)
    consolidate(src, dst, overwrite=True, dtype=torch.bfloat16)
    assert {t.dtype for t in load_state_dict(dst).values()} == {torch.bfloat16}


def test_inspect_describes_a_checkpoint_and_a_handoff(checkpoint, tmp_path):
    src, masters = checkpoint
    described = inspect_checkpoint(src)
    assert described["kind"] == "deepspeed"
    assert {t["name"] for t in described["tensors"]} == set(masters)
    consolidate(src, str(tmp_path / "handoff"))
    handoff = inspect_checkpoint(str(tmp_path / "handoff"))
    assert handoff["kind"] == "handoff" and {t["name"] for t in handoff["tensors"]} == set(masters)
