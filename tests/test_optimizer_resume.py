"""stages/optimizer_resume.py: the optimizer state beside a ``resume_from`` handoff put into a fit's engine, on a
real 1-rank ZeRO-3 engine in the test process. A handoff consolidated with ``--optimizer`` gives another engine
the moments bit for bit; one without optimizer state leaves the engine's own, and says so."""

from __future__ import annotations

import pytest
import torch
from test_engine import build, process_group  # noqa: F401 - fixtures
from torch import nn

from stagesafe.consolidate import consolidate
from stagesafe.publishing.save import save_state_dict
from stagesafe.stages.history import HandoffTarget
from stagesafe.stages.optimizer_resume import resume_optimizer

pytestmark = pytest.mark.timeout(300)

deepspeed = pytest.importorskip("deepspeed")


def _trained(build, seed: int):  # noqa: F811 - the fixture imported above
    torch.manual_seed(seed)
    engine = build(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    engine.backward(engine(torch.randn(3, 8)).pow(2).mean())
    engine.step()
    return engine


def _moments(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_optimizer_state

    return {f"{n}/{key}": safe_get_full_optimizer_state(p, key).clone()
            for n, p in engine.module.named_parameters() for key in ("exp_avg", "exp_avg_sq")}


def test_the_state_beside_a_handoff_goes_into_the_engine_bit_for_bit(build, tmp_path):  # noqa: F811
    writer = _trained(build, 1)
    writer.save_checkpoint(str(tmp_path / "ckpt"))
    expected = _moments(writer)
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "handoff"), optimizer=True)
    reader = _trained(build, 2)
    assert resume_optimizer(reader, HandoffTarget(uri=str(tmp_path / "handoff"))) is True
    got = _moments(reader)
    for name, value in expected.items():
        assert torch.equal(got[name].view(torch.int32), value.view(torch.int32)), name


def test_a_handoff_without_optimizer_state_leaves_the_engines_own(build, tmp_path):  # noqa: F811
    engine = _trained(build, 3)
    before = _moments(engine)
    save_state_dict({"0.weight": torch.zeros(16, 8)}, str(tmp_path / "weights"))
    assert resume_optimizer(engine, HandoffTarget(uri=str(tmp_path / "weights"))) is False
    after = _moments(engine)
    assert all(torch.equal(after[name], value) for name, value in before.items())
