"""zero/engine/optimizer_out.py: what a live 1-rank ZeRO-3 engine's optimizer holds, in the form beside a
handoff: the keys held per element, the trained parameters with their full shapes, the hyperparameters."""

from __future__ import annotations

import pytest
from _engine_nets import net, step
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.zero.engine.optimizer_out import describe_optimizer

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


def test_adamw_holds_two_moments_per_element_and_its_hyperparameters(build):  # noqa: F811
    model = net()
    model[2].bias.requires_grad_(False)
    engine = build(model)
    step(engine)
    described = describe_optimizer(engine)
    assert described.keys == ["exp_avg", "exp_avg_sq"]
    trained = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    assert {name: shape for name, shape, _ in described.trained} == {n: tuple(s) for n, s in trained.items()}
    assert [group["lr"] for group in described.hyperparameters] == [0.1]
    assert all("params" not in group for group in described.hyperparameters)
