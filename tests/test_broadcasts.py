"""zero/engine/broadcasts.py: DeepSpeed's per-parameter broadcasts at engine build made one per bucket; on one
rank, an engine built inside holds the module's values bit for bit, and DeepSpeed's own methods are back after."""

from __future__ import annotations

import pytest
from _engine_nets import net, state
from _tensors import assert_bitwise_equal
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.zero.engine.broadcasts import flat_broadcasts
from stagesafe.zero.engine.values_out import GatheredValues

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


def test_an_engine_built_with_bucketed_broadcasts_holds_the_modules_values(build):  # noqa: F811
    from deepspeed.runtime.engine import DeepSpeedEngine

    before = DeepSpeedEngine._broadcast_model
    model = net(3)
    expected = state(model)
    with flat_broadcasts():
        build(model)
    assert DeepSpeedEngine._broadcast_model is before  # DeepSpeed's own again
    gathered = GatheredValues(model, lambda name, tensor: tensor)
    assert_bitwise_equal({n: gathered[n] for n in sorted(gathered)}, dict(sorted(expected.items())))
