"""A small module and a trained 1-rank ZeRO-3 engine of it, for the tests of each zero/engine/ module."""

from __future__ import annotations

import torch
from torch import nn


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def step(engine) -> None:
    engine.backward(engine(torch.randn(2, 6, device=engine.device)).pow(2).mean())
    engine.step()


def consolidated_with_optimizer(build, folder) -> tuple[nn.Module, str]:
    """A trained engine's module, and the handoff (weights and optimizer state) its checkpoint consolidates into
    under ``folder``."""
    from stagesafe.consolidate import consolidate

    model = net()
    engine = build(model)
    step(engine)
    engine.save_checkpoint(str(folder / "ckpt"))
    consolidate(str(folder / "ckpt"), str(folder / "handoff"), optimizer=True)
    return model, str(folder / "handoff")
