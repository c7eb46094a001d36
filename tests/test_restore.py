"""stagesafe.restore and check_fits on real modules and real handoffs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stagesafe import StateDictMismatchError, restore, save_state_dict
from stagesafe.restore import check_fits


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.tensor(3, dtype=torch.int64))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


@pytest.fixture
def handoff(tmp_path):
    torch.manual_seed(1)
    source = Tied()
    uri = str(tmp_path / "handoff")
    save_state_dict(source.state_dict(), uri)
    return uri, source


def test_restore_into_a_fresh_module_bitwise_and_keeps_tying(handoff):
    uri, source = handoff
    torch.manual_seed(2)
    target = Tied()
    weight_object = target.body.weight
    assert restore(target, uri) is target
    for name, tensor in source.state_dict().items():
        assert torch.equal(_bits(target.state_dict()[name]), _bits(tensor)), name
    assert target.head.weight is target.embed.weight  # still tied
    assert target.body.weight is weight_object  # parameter identity kept


def test_restore_keeps_the_module_dtype(handoff):
    uri, source = handoff
    target = Tied().to(torch.bfloat16)
    restore(target, uri)
    assert target.body.weight.dtype == torch.bfloat16
    assert torch.equal(target.body.weight, source.body.weight.to(torch.bfloat16))
    assert target.steps.dtype == torch.int64


def test_restore_materialises_a_meta_module(handoff):
    uri, source = handoff
    with torch.device("meta"):
        target = Tied()
    restore(target, uri)
    assert target.body.weight.device.type == "cpu"
    assert torch.equal(target.body.weight, source.body.weight)


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda sd: sd.pop("body.bias"), "missing keys: body.bias"),
        (lambda sd: sd.update(extra=torch.zeros(2)), "unexpected keys: extra"),
        (lambda sd: sd.update({"body.weight": torch.zeros(6, 5)}), "reshaped keys: body.weight: module [6, 6] vs [6, 5]"),
    ],
)
def test_a_handoff_that_does_not_fit_is_refused_and_the_module_untouched(tmp_path, change, expected):
    torch.manual_seed(1)
    state = dict(Tied().state_dict())
    change(state)
    uri = str(tmp_path / "bad")
    save_state_dict(state, uri)
    torch.manual_seed(2)
    target = Tied()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(StateDictMismatchError) as info:
        restore(target, uri)
    assert expected in str(info.value) and "The module was not changed" in str(info.value)
    assert isinstance(info.value, KeyError)
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[name])


def test_check_fits_lists_every_kind_of_mismatch():
    state = dict(Tied().state_dict())
    state.pop("embed.weight")
    state["body.bias"] = torch.zeros(7)
    state["ghost"] = torch.zeros(1)
    with pytest.raises(StateDictMismatchError, match=r"missing keys: embed.weight; unexpected keys: ghost; reshaped keys: body.bias: module \[6\] vs \[7\]"):
        check_fits(Tied(), state)
