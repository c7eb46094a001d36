"""zero/engine/traces.py: the state an engine leaves on a module, found and taken away, on a 1-rank ZeRO-3
engine: after destroy and strip the module is as it was (its user's hooks kept), and nothing stale is found."""

from __future__ import annotations

import pytest
from _engine_nets import net
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.zero.engine.traces import (
    destroy_engine,
    find_stale_state,
    is_engine,
    strip_deepspeed_state,
    take_footprint,
)

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


def test_a_module_an_engine_left_is_found_stale_until_stripped_to_its_footprint(build):  # noqa: F811
    model = net()
    handle = model[0].register_forward_hook(lambda module, args, output: None)
    assert find_stale_state(model) == []
    footprint = take_footprint(model)
    engine = build(model)
    assert is_engine(engine) and not is_engine(model)
    destroy_engine(engine)
    assert find_stale_state(model)  # ds_* attributes and the like are still there
    strip_deepspeed_state(model, footprint)
    assert find_stale_state(model) == []
    assert handle.id in model[0]._forward_hooks  # the user's hook stays
    assert not any(name.startswith("ds_") for p in model.parameters() for name in vars(p))
