"""A checkpoint folder read at a Trainer call's start (Lightning's ``ckpt_path``), for the engine of this job.

One written during a ``fit`` (by stagesafe, stock Lightning or DeepSpeed, by any number of ranks), loaded into a
training engine: this rank's share read by stagesafe's reader and re-partitioned for this job, then loaded by
DeepSpeed's own methods (:func:`load_training_checkpoint`). Any other (one written between calls, weights only,
or any folder for an inference engine, whose ZeRO-Offload optimizer cannot load one): its fp32 weights read
here, for the boundary to put into the partitions (:func:`read_weights_checkpoint`). No Lightning here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from stagesafe.stages import collectives
from stagesafe.zero import engine as zero_engine

__all__ = ["check_keys", "load_training_checkpoint", "read_weights_checkpoint"]


def load_training_checkpoint(engine: Any, path: str, *, strict: bool) -> dict[str, Any]:
    """``fit(ckpt_path=path)``: weights, fp32 masters, optimizer state, loss scaler and counters put into
    ``engine``. Every rank reads before any loads (collectives: every rank calls it), so a checkpoint one rank
    refuses is refused on every rank, unchanged. Returns the client state (Lightning's loops, lr schedulers,
    callbacks, ...)."""
    files, client_state = collectives.all_ranks(
        lambda: zero_engine.read_rank_files(engine, path),
        f"reading the checkpoint {path} (every rank reads its share of it: a node-local folder is not visible "
        "from other nodes; save it to shared storage)",
    )
    zero_engine.load_rank_files(engine, files, strict=strict)
    return client_state


def read_weights_checkpoint(path: str) -> dict[str, Any]:
    """The client state of the checkpoint at ``path``, its ``"state_dict"`` the fp32 weights read from its
    partitions (no pickle of it is run)."""
    from stagesafe.consolidate import load_zero_checkpoint_with_client_state

    values, client_state = load_zero_checkpoint_with_client_state(path)
    client_state = dict(client_state)
    client_state["state_dict"] = values
    return client_state


def check_keys(module: nn.Module | None, state_dict: Mapping[str, Any], strict: bool) -> None:
    """Refuse a checkpoint that does not fit the module (with ``strict``), before anything is loaded."""
    if module is None or not strict:
        return
    from stagesafe.restore import check_fits

    check_fits(module, state_dict)
