"""stagesafe.zero.engine.optimizer on plain data: the given-back optimizer follows parameter objects stagesafe
replaced (``repoint``). Its groups over a live engine's parameters: tests/test_trainer_attributes.py."""

from __future__ import annotations

import torch
from torch import nn

from stagesafe.zero.engine import repoint


def test_groups_and_state_follow_the_parameters_of_the_same_names():
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer = torch.optim.AdamW([{"params": module[0].parameters()}, {"params": module[1].parameters(), "lr": 0.1}])
    old = list(module.parameters())
    optimizer.state[old[0]] = {"exp_avg": torch.ones(2, 2)}
    names = [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
    fresh = {n: nn.Parameter(torch.empty_like(p, device="meta")) for n, p in module.named_parameters()}
    repoint(optimizer, names, fresh)
    assert [g["params"] for g in optimizer.param_groups] == [[fresh["0.weight"], fresh["0.bias"]],
                                                             [fresh["1.weight"], fresh["1.bias"]]]
    assert list(optimizer.state) == [fresh["0.weight"]] and optimizer.param_groups[1]["lr"] == 0.1
    repoint(optimizer, names, fresh)  # the same objects: nothing moves
    assert list(optimizer.state) == [fresh["0.weight"]]


def test_groups_the_user_changed_are_left_as_they_are():
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD([module.weight], lr=0.1)
    fresh = {"weight": nn.Parameter(torch.zeros(2, 2)), "bias": nn.Parameter(torch.zeros(2))}
    repoint(optimizer, [["weight", "bias"]], fresh)  # the group holds one parameter, not the two named
    assert optimizer.param_groups[0]["params"] == [module.weight]
    repoint(optimizer, [["gone"]], fresh)
    assert optimizer.param_groups[0]["params"] == [module.weight]
