"""The optimizer ``configure_optimizers`` returned, given back over the module's parameters once its engine goes.

DeepSpeed's ZeRO optimizer wraps the user's optimizer (its "basic" optimizer) and rewrites that object: each
param group's ``params`` become the engine's flat fp32 partitions, and its state is keyed by them. After the engine
is destroyed those partitions would be kept alive by the object Lightning's ``trainer.optimizers`` and the lr
schedulers still name. :func:`optimizer_layout`, taken while the engine lives, records which of the module's
parameters each group trains; :func:`plain_optimizer`, once the engine is gone, points the groups at them again
and lets go of the partition-keyed state (what the engine held of it is kept beside the module, see
:mod:`stagesafe.stages.between_calls`; the layout also records where each parameter's state lies in
it, for the views :mod:`.optimizer_views` gives the optimizer). The hyperparameters stay as the fit left them (the
lr its schedulers set).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stagesafe.zero.engine.optimizer_views import StatePlaces, state_places

__all__ = ["OptimizerLayout", "optimizer_layout", "plain_optimizer", "repoint"]


@dataclass
class OptimizerLayout:
    """The user's optimizer, and for each of its param groups the module's parameters it trains, in order;
    ``places``: where each one's state lies in the kept checkpoint files (None where stagesafe does not lay it
    out)."""

    optimizer: torch.optim.Optimizer
    groups: list[list[nn.Parameter]]
    places: StatePlaces | None = None


def optimizer_layout(engine: Any) -> OptimizerLayout | None:
    """Read from a live training engine (ZeRO 1, 2 or 3); None where its optimizer is not one of those (an
    inference engine, another wrapper)."""
    zero = getattr(engine, "optimizer", None)
    basic = getattr(zero, "optimizer", None)
    if not isinstance(basic, torch.optim.Optimizer):
        return None
    groups: list[list[nn.Parameter]] = [[] for _ in basic.param_groups]
    if hasattr(zero, "sub_group_to_group_id") and hasattr(zero, "fp16_groups"):  # ZeRO-3: sub-groups of a group
        for index, sub_group in enumerate(zero.fp16_groups):
            group = zero.sub_group_to_group_id[index]
            if not 0 <= group < len(groups):
                return None
            groups[group].extend(sub_group)
    elif hasattr(zero, "bit16_groups") and len(zero.bit16_groups) == len(groups):  # ZeRO 1 and 2: one per group
        for group, params in zip(groups, zero.bit16_groups):
            group.extend(params)
    else:
        return None
    return OptimizerLayout(basic, groups, state_places(engine))


def plain_optimizer(layout: OptimizerLayout) -> torch.optim.Optimizer:
    """The user's optimizer, once the engine is gone: each group over the module's parameters it trains, its
    hyperparameters as they ended, its state empty (the partitions it was keyed by are the engine's)."""
    optimizer = layout.optimizer
    for group, params in zip(optimizer.param_groups, layout.groups):
        group["params"] = list(params)
    optimizer.state = defaultdict(dict)
    return optimizer


def repoint(optimizer: torch.optim.Optimizer, names: list[list[str]], params: Mapping[str, nn.Parameter]) -> None:
    """Point the given-back ``optimizer``'s groups (``names``: the state-dict names of each group's parameters)
    at the module's ``params`` of those names, where stagesafe replaced the parameter objects (a module moved to
    or from the meta device between calls); each parameter's state follows it."""
    for group, group_names in zip(optimizer.param_groups, names):
        if len(group["params"]) != len(group_names) or any(n not in params for n in group_names):
            continue  # the user changed the groups since: left as they are
        fresh = [params[n] for n in group_names]
        for old, new in zip(group["params"], fresh):
            if old is not new and old in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(old)
        group["params"] = fresh
