"""zero/engine/values_in.py: exact values put into a live 1-rank ZeRO-3 engine (its partitions and fp32 masters),
read back bit for bit."""

from __future__ import annotations

import pytest
import torch
from _engine_nets import net, state
from _tensors import assert_bitwise_equal
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.zero.engine.values_in import load_values_into_engine, set_fp32_masters
from stagesafe.zero.engine.values_out import GatheredValues

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


def _read(model) -> dict[str, torch.Tensor]:
    gathered = GatheredValues(model, lambda name, tensor: tensor)
    return {name: gathered[name].clone() for name in sorted(gathered)}


def test_values_loaded_are_the_values_read_back(build):  # noqa: F811
    model = net(0)
    values = state(net(1))
    build(model)
    load_values_into_engine(model, values, set_masters=True)
    assert_bitwise_equal(_read(model), dict(sorted(values.items())))


def test_masters_are_set_once_each_and_only_for_trained_parameters(build):  # noqa: F811
    model = net(0)
    model[0].bias.requires_grad_(False)
    values = state(net(2))
    build(model)
    assert set_fp32_masters(model, values) == sum(1 for p in model.parameters() if p.requires_grad)
    masters = {n: deepspeed.utils.safe_get_full_fp32_param(p) for n, p in model.named_parameters() if p.requires_grad}
    assert_bitwise_equal(dict(sorted(masters.items())), {n: values[n] for n in sorted(masters)})
