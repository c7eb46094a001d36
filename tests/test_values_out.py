"""zero/engine/values_out.py: the weights read out of a live 1-rank ZeRO-3 engine: the full shapes and dtypes
behind its placeholders, and the values, bit for bit."""

from __future__ import annotations

import pytest
import torch
from _engine_nets import net, state
from _tensors import assert_bitwise_equal
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.zero.engine.values_out import GatheredValues, full_specs

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


def test_the_specs_and_values_are_those_of_the_module_before_the_engine(build):  # noqa: F811
    model = net()
    expected = state(model)
    build(model)
    specs, aliases = full_specs(model)
    assert specs == {name: (t.shape, t.dtype) for name, t in expected.items()} and aliases == {}
    gathered = GatheredValues(model, lambda name, tensor: tensor)
    assert sorted(gathered) == sorted(expected)
    assert_bitwise_equal({name: gathered[name] for name in sorted(gathered)}, dict(sorted(expected.items())))


def test_each_value_goes_through_the_callers_conversion(build):  # noqa: F811
    model = net()
    build(model)
    gathered = GatheredValues(model, lambda name, tensor: tensor.to(torch.bfloat16))
    assert {gathered[name].dtype for name in gathered} == {torch.bfloat16}
