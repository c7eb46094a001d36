"""``trainer.save_checkpoint`` between Trainer calls, when no engine is live: the files the last ``fit``'s engine
would have written at its end (every rank its own, optimizer state included), kept since; without them (a module
changed since, ``keep_optimizer_state=False``), the same folder layout with weights only, written by rank 0,
with a warning that names what is missing. No Lightning here: the strategy passes its collective and its
warning."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from stagesafe.stages import collectives
from stagesafe.stages.between_calls import kept_files, kept_training, weights_between_calls
from stagesafe.stages.history import KeptTraining
from stagesafe.stages.writer import HandoffWriter
from stagesafe.zero.checkpoint_writer import write_engine_checkpoint, write_zero_checkpoint

__all__ = ["save_between_calls"]


def save_between_calls(
    module: nn.Module,
    checkpoint: Mapping[str, Any],
    path: str,
    *,
    world_size: int,
    rank_zero: bool,
    zero_stage: int,
    exclude_frozen: bool,
    writers: Iterable[HandoffWriter],
    barrier: Callable[[str], None],
    warn: Callable[[str], None],
) -> None:
    """Write ``checkpoint`` (Lightning's, its ``state_dict`` and ``optimizer_states`` left out) as DeepSpeed's
    folder at ``path``, on every rank. ``barrier(name)``: every rank waits for the others' files;
    ``warn(text)``: rank 0's warning for a training checkpoint written without optimizer state."""
    client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    kept, missing = _on_every_rank(*kept_training(module, world_size=world_size))
    if kept is not None:
        assert kept.checkpoint is not None
        client["lr_schedulers"] = kept.lr_schedulers
        write_engine_checkpoint(path, kept_files(kept, module), client_state=client, latest=rank_zero)
        barrier("stagesafe: checkpoint written")
        return
    if "lr_schedulers" in client:  # weights only, as the warning says: schedulers start afresh with the optimizer
        client["lr_schedulers"] = []
    if checkpoint.get("loops") is not None:  # a training checkpoint (weights-only ones have no loops)
        warn(
            f"trainer.save_checkpoint({path!r}) between Trainer calls writes the weights but no "
            f"optimizer state, lr scheduler or loss scaler: {missing}. A later fit(ckpt_path=...) starts the "
            "optimizer afresh from these weights."
        )
    if rank_zero:
        values = weights_between_calls(module, writers)
        write_zero_checkpoint(
            path, module, values=values, zero_stage=zero_stage, client_state=client, exclude_frozen=exclude_frozen
        )


def _on_every_rank(kept: KeptTraining | None, missing: str) -> tuple[KeptTraining | None, str]:
    """The kept state where every rank has its own (a ``step()`` between calls on one rank's optimizer makes
    that rank's match no weights): else no rank writes it, and the reason names the ranks without it."""
    reasons = collectives.gather_all(lambda: "" if kept is not None else missing, "checking the kept optimizer state")
    lacking = {rank: reason for rank, reason in enumerate(reasons) if reason}
    if not lacking:
        return kept, ""
    if len(reasons) == 1:
        return None, lacking[0]
    return None, "; ".join(f"rank {rank}: {reason}" for rank, reason in lacking.items())
