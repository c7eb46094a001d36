"""What a stage's entry checks and reads before any engine is built, apart from the boundary that calls it.

The module carries no earlier engine's state (:func:`assert_clean`); a module's first stage under stagesafe
takes ``resume_from``'s weights and starts its history (:func:`first_stage`); the handoff that holds the
module's weights is still there, whole (:func:`check_still_there`); a module of meta tensors has its engine's
partitions built from that handoff (:func:`build_from_handoff`). Each is a collective where it says so: every
rank calls it at the same point, and a failure on one rank is raised on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from stagesafe.errors import HandoffCorruptError, HandoffNotFoundError, InvalidArgumentError, StaleDeepSpeedStateError
from stagesafe.handoff.read import HandoffReader, check_present, read_manifest
from stagesafe.restore import assign_values, load_for
from stagesafe.stages import collectives
from stagesafe.stages.history import HandoffTarget, ModuleHistory, new_history, state_tensors
from stagesafe.stages.writer import HandoffWriter
from stagesafe.zero import engine as zero_engine

__all__ = ["assert_clean", "build_from_handoff", "check_still_there", "first_stage"]

log = logging.getLogger("stagesafe.stages.boundary")  # the boundary's logger: its lines keep their name


def assert_clean(module: nn.Module, *, fresh: set[int] | frozenset[int] = frozenset()) -> None:
    """Raise :class:`StaleDeepSpeedStateError` when the module still carries an earlier engine's state.
    ``fresh``: ids of parameters DeepSpeed's ``zero.Init`` built in this call (Lightning's ``configure_model``)."""
    problems = zero_engine.find_stale_state(module, fresh=fresh)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise StaleDeepSpeedStateError(
            f"The module still carries state of an earlier DeepSpeed engine: {shown}. Building a new engine over it "
            "would re-adopt stale ZeRO partitions. Run every stage through StageSafeDeepSpeedStrategy, or load the "
            "weights into a fresh module with stagesafe.restore(module, handoff_uri)."
        )


def first_stage(
    module: nn.Module,
    tensors: dict[str, torch.Tensor],
    *,
    resume_from: HandoffTarget | None,
    target: HandoffTarget,
    on_meta: bool,
    weights_from: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], ModuleHistory]:
    """A module's first stage under stagesafe: it takes ``resume_from``'s weights (a module of meta tensors
    is built from that handoff instead), and its history starts, naming this call as where its weights are
    from unless they are resumed. ``target``: the handoff this stage writes. Returns the module's tensors."""
    bound = None
    if resume_from is not None and not on_meta:
        tensors, bound = _resume(module, resume_from, target)
    history = new_history(module)
    history.weights_from = dict(weights_from)
    if resume_from is not None:
        history.target = resume_from if on_meta else None
        history.weights_from = {"resumed_from": resume_from.uri}
        if bound is not None:  # written again where they were read, the weights still name their optimizer state
            history.weights_from["optimizer"] = bound
            history.bind_state(resume_from.uri, tensors)
    return tensors, history


def _resume(
    module: nn.Module, source: HandoffTarget, target: HandoffTarget
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Every rank loads and checks the handoff; none changes its module unless all can. Returns the module's
    tensors and, where this stage's handoff (``target``) is that same folder, the optimizer state its weights
    name (which a write of the same weights there names again)."""

    def read() -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        placed = load_for(module, source.uri, storage_options=source.storage_options,
                          progress=None if collectives.rank() == 0 else False)  # one bar, on rank 0's terminal
        if source.uri.rstrip("/") != target.uri.rstrip("/"):
            return placed, None
        bound = read_manifest(source.uri, storage_options=source.storage_options)["metadata"].get("optimizer")
        return placed, bound

    placed, bound = collectives.all_ranks(
        read,
        f"reading the handoff to resume from at {source.uri} (every rank reads it: a node-local path is "
        "not visible from other nodes; use shared storage or an object store)",
    )
    zero_engine.strip_deepspeed_state(module, None)
    assign_values(module, placed)
    return state_tensors(module), bound


def check_still_there(history: ModuleHistory, target: HandoffTarget, writer: HandoffWriter, *, on_meta: bool) -> None:
    """The handoff that holds the module's weights may have been deleted or damaged since it was written
    (rank 0 looks; every rank acts on what it saw). A module with weights writes it again at this stage
    (``target``); a module of meta tensors has nothing to write it from: its error is raised, naming the
    handoff. ``writer``: the strategy's, whose write not yet joined is not looked at."""
    source = history.target
    if source is None or history.fingerprint is None or writer.pending_uri == source.uri:
        return
    if source != target and not on_meta:
        return  # the module's weights go to this stage's handoff in any case
    absent = collectives.on_rank_zero(lambda: _absence(source), f"looking at the handoff {source.uri}")
    if absent is None:
        return
    missing, error = absent
    if on_meta:
        raise (HandoffNotFoundError if missing else HandoffCorruptError)(
            f"the module holds meta tensors, and the handoff that holds its weights is gone or damaged: {error}. "
            "Nothing can rebuild them here: resume from another copy (resume_from=URI on a fresh module)"
        )
    log.warning("stagesafe: %s; this stage writes the module's weights there again", error)
    history.lost()


def build_from_handoff(
    history: ModuleHistory, writer: HandoffWriter, materialize: Callable[[Mapping[str, torch.Tensor]], None]
) -> HandoffReader:
    """A module of meta tensors: the engine's partitions are built (``materialize``) from the handoff that
    holds its weights, one shard and one submodule at a time. Returns the handoff, the weights the stage starts
    with. ``writer``: the strategy's, whose write to that handoff is joined first."""
    source = history.target
    if source is None:
        raise InvalidArgumentError(
            "the module holds meta tensors and no handoff holds its weights: pass resume_from=URI, or load "
            "them with stagesafe.restore(module, uri) first"
        )
    if writer.pending_uri == source.uri:
        writer.join()  # this stage reads the handoff: its write must be committed
    reader = HandoffReader(source.uri, storage_options=source.storage_options)
    collectives.all_ranks(lambda: materialize(reader), f"building the engine's partitions from {source.uri}")
    return reader


def _absence(target: HandoffTarget) -> tuple[bool, str] | None:
    """Why the handoff at ``target`` is not there whole (``missing``: it is gone), or None."""
    try:
        check_present(target.uri, storage_options=target.storage_options)
    except HandoffNotFoundError as exc:
        return True, str(exc)
    except HandoffCorruptError as exc:
        return False, str(exc)
    return None
