"""zero/engine/optimizer.py: the user's optimizer given back over the module's parameters once the engine is
gone, read from a 1-rank ZeRO-3 engine: its class, hyperparameters as they ended, each group's parameters, no
state."""

from __future__ import annotations

import pytest
import torch
from _engine_nets import net, step
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.zero.engine.optimizer import optimizer_layout, plain_optimizer

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


def test_no_layout_where_the_engine_has_no_optimizer_of_its_own(build):  # noqa: F811
    engine = build(net(), optimizer=False)
    assert optimizer_layout(engine) is None
    assert optimizer_layout(object()) is None


def test_the_users_optimizer_comes_back_over_the_modules_parameters(build):  # noqa: F811
    model = net()
    engine = build(model)
    step(engine)
    layout = optimizer_layout(engine)
    assert layout is not None
    assert [id(p) for group in layout.groups for p in group] == [id(p) for p in model.parameters()]
    optimizer = plain_optimizer(layout)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    assert optimizer.param_groups[0]["lr"] == 0.1 and len(optimizer.state) == 0
