"""zero/engine/parameters.py: what a parameter says of ZeRO, on a plain module and on a 1-rank ZeRO-3 engine's."""

from __future__ import annotations

import pytest
from _engine_nets import net
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.zero.engine.parameters import full_shape, has_fp32_master, is_zero3_param

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


def test_a_plain_parameter_is_not_zero3_and_its_shape_is_its_own():
    model = net()
    weight = model[0].weight
    assert not is_zero3_param(weight) and not has_fp32_master(weight)
    assert full_shape(weight) == weight.shape


def test_a_partitioned_parameter_keeps_its_full_shape_and_a_trained_one_its_master(build):  # noqa: F811
    model = net()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    model[2].bias.requires_grad_(False)
    build(model)
    for name, p in model.named_parameters():
        assert is_zero3_param(p) and full_shape(p) == shapes[name]
        assert has_fp32_master(p) == p.requires_grad, name
