"""What a module holds between Trainer calls (no engine is live): the optimizer a fit gives back, its state views
into the last fit's kept engine state (at one rank, or shared by one host's ranks); and for a checkpoint written
then, that kept state where it still belongs to the module's weights (its fp32 master partitions built again from
them), or else the weights alone, read from the handoff for a module of meta tensors."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from torch import nn

from stagesafe.errors import HandoffNotReadyError, InvalidArgumentError
from stagesafe.stages.history import KeptTraining, ModuleHistory, history_of, state_tensors
from stagesafe.stages.writer import HandoffWriter
from stagesafe.zero.engine import OptimizerLayout, attach_views, built_partitions, plain_optimizer, repoint

__all__ = [
    "given_back_optimizer", "follow_parameters", "kept_training", "kept_files", "weights_between_calls",
    "has_meta_tensors",
]


def given_back_optimizer(
    module: nn.Module | None, layout: OptimizerLayout, *, timeout: float,
) -> torch.optim.Optimizer:
    """After a fit, the user's optimizer over the module's parameters (:func:`plain_optimizer`), its state the
    fit's kept state where this rank sees each parameter's whole (one rank, or the ranks of one host sharing it:
    :mod:`~stagesafe.stages.shared_state`): views into it, owned by the kept
    state (``KeptTraining.drop_views`` empties them when it goes). A ``step()`` on them makes the kept state match
    no weights. Otherwise its state is empty. Where the kept state is still to be copied off the device, the
    views are made on the state's first use after the call returned, waiting ``timeout`` seconds at most (the
    strategy's, which its writer waits for anything too)."""
    optimizer = plain_optimizer(layout)
    history = history_of(module) if module is not None else None
    if history is None or module is None:
        return optimizer
    _note_given_back(history, module, optimizer)
    kept = history.kept
    if kept is None or kept.checkpoint is None or layout.places is None or not kept.holds(state_tensors(module)):
        return optimizer
    kept.drop_views()
    owner = weakref.ref(kept)  # the optimizer the user holds does not keep the kept state alive, nor it the optimizer
    why = f"{type(optimizer).__name__}.step() (trainer.optimizers) ran on it between Trainer calls"

    def stepped() -> None:
        held = owner()
        if held is not None:
            held.outdated(why)

    kept.views = attach_views(optimizer, kept.checkpoint, layout.places, on_step=stepped, copied=kept.copied,
                              timeout=timeout, shared=kept.shared.ready if kept.shared is not None else None)
    return optimizer


def _note_given_back(history: ModuleHistory, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Remember the given-back optimizer (weakly) and its groups' parameters by name, for
    :func:`follow_parameters`."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = [group["params"] for group in optimizer.param_groups]
    if all(id(p) in names for params in groups for p in params):
        history.given_back = (weakref.ref(optimizer), [[names[id(p)] for p in params] for params in groups])


def follow_parameters(module: nn.Module) -> None:
    """stagesafe replaced the module's parameter objects (meta mode, between calls): the optimizer the last fit
    gave back, and its state, follow them by name, so that it stays over the module's parameters."""
    history = history_of(module)
    given = history.given_back if history is not None else None
    optimizer = given[0]() if given is not None else None
    if optimizer is not None:
        repoint(optimizer, given[1], dict(module.named_parameters()))


def kept_training(module: nn.Module, *, world_size: int) -> tuple[Optional[KeptTraining], str]:
    """The last fit's kept engine state where it still belongs to the module's weights, else why not."""
    history = history_of(module)
    kept = history.kept if history is not None else None
    if kept is None:
        return None, "no fit under StageSafeDeepSpeedStrategy has trained this module's weights in this process"
    if kept.checkpoint is None:
        return None, kept.missing
    if kept.outdated_by:
        return None, kept.outdated_by
    if not kept.holds(state_tensors(module)):
        return None, "the module's weights changed since the last fit ended, and its optimizer state with them"
    if kept.world_size != world_size:
        return None, f"it was kept by {kept.world_size} rank(s) and this job has {world_size}"
    return kept, ""


def kept_files(kept: KeptTraining, module: nn.Module) -> dict[str, dict[str, Any]]:
    """The kept checkpoint files as DeepSpeed writes them: the fp32 master partitions kept as recipes are built
    from the module's values (unchanged since the fit: :func:`kept_training` checked) and the kept fp32 masters
    of the parameters it holds in 16 bits. Holds this rank's partitions once more while they are written."""
    assert kept.checkpoint is not None
    values = {**state_tensors(module), **kept.masters}
    return built_partitions(kept.checkpoint, values)


def weights_between_calls(module: nn.Module, writers: Iterable[HandoffWriter]) -> Optional[Mapping[str, Any]]:
    """None when the module holds its weights; its handoff's when it holds meta tensors (``writers``: those
    that may still be writing that handoff)."""
    if not has_meta_tensors(module):
        return None
    history = history_of(module)
    if history is None or history.target is None:
        raise InvalidArgumentError(
            "the module holds meta tensors and no handoff holds its weights: nothing to save; load weights "
            "into it first (stagesafe.restore(module, uri))"
        )
    for writer in writers:
        if writer.pending_uri == history.target.uri:
            raise HandoffNotReadyError(
                f"the handoff {history.target.uri!r} that holds the module's weights is still being written: call "
                "strategy.wait_for_handoff() on every rank before trainer.save_checkpoint(...)"
            )
    from stagesafe.handoff.read import load_state_dict

    return load_state_dict(history.target.uri, storage_options=history.target.storage_options)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in module.state_dict(keep_vars=True).values() if hasattr(t, "device"))
