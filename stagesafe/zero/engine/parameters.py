"""What a parameter says of ZeRO: partitioned by ZeRO-3 or not, its full shape, whether the optimizer keeps an
fp32 master of it; a module's state-dict tensors by name; ZeRO-3 parameters made whole for a block. The small
vocabulary the other files of :mod:`stagesafe.zero.engine` share."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def is_zero3_param(param: torch.Tensor) -> bool:
    """Partitioned by ZeRO-3 (``zero.Init`` or an engine): its values live in the engine, not in ``.data``."""
    return hasattr(param, "ds_id")


def has_fp32_master(param: torch.Tensor) -> bool:
    """True when the engine's optimizer holds a full-precision master copy of this parameter."""
    if not param.requires_grad:
        return False
    if is_zero3_param(param):
        return getattr(param, "_z3_optimizer", None) is not None
    # ZeRO 1/2 link every parameter of the optimizer's groups, on every rank (``_hp_mapping`` is None where
    # another rank holds the fragment), so this answer is the same everywhere and the gathers of values_out match.
    return "get_full_hp_param" in vars(param)


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of a parameter's values, also for a ZeRO-3 placeholder whose ``.data`` is empty."""
    return getattr(param, "ds_shape", param.shape)


@contextlib.contextmanager
def gathered_params(params: list[nn.Parameter], modifier_rank: int | None = None) -> Iterator[None]:
    """Make ZeRO-3 parameters whole for the duration of the block (a collective: every rank enters)."""
    partitioned = [p for p in params if is_zero3_param(p)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def named_tensors(module: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    """Parameters and persistent buffers by their state-dict name (tied parameters appear once per name)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    state_keys = set(module.state_dict(keep_vars=True).keys())
    buffers = {n: b for n, b in module.named_buffers(remove_duplicate=False) if n in state_keys}
    return params, buffers
