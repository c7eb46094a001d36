"""What the strategy tells the user, through Lightning's rank-zero logging: the line a committed background write
prints, the line each stage boundary logs, whether a resumed optimizer continues, and the warning for a ``fit``
that has nothing left to train."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from stagesafe.boundary_report import BoundaryReport
from stagesafe.errors import describe
from stagesafe.publishing.commit import Commit

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "boundary_line", "megabytes", "say_committed", "say_optimizer_resumed", "say_unchanged", "say_versioned",
    "warn_if_fit_has_nothing_left",
]


def say_committed(uri: str, commit: Commit, seconds: float) -> None:
    """Rank 0's line, at Lightning's default level, once a background write has committed. Its size is the
    tensors' bytes (the index's ``total_size``), as the boundary line and ``last_boundary.handoff_bytes`` say."""
    size = commit.manifest["total_size"]
    metadata = commit.manifest.get("metadata", {})
    what = f"{metadata.get('stage')}, step {metadata.get('global_step')}" if metadata.get("stage") else "weights"
    if metadata.get("call_failed"):
        what += ", the call failed there"
    rank_zero_info(f"stagesafe: handoff committed at {uri} ({what}; {megabytes(size)} in {seconds:.1f} s)")


def say_versioned(asked: str, uri: str) -> None:
    """Rank 0's line when the default handoff folder holds another run's handoff and this run writes beside it."""
    rank_zero_info(
        f"stagesafe: {asked} holds a handoff of another run, which is kept; this run's handoff is written to {uri} "
        "(strategy.last_boundary.uri names it)"
    )


def say_optimizer_resumed(uri: str, resumed: bool) -> None:
    """Rank 0's line when a fit's module took ``resume_from``'s weights: whether the optimizer continues from the
    state beside them, or starts afresh (the handoff holds weights only)."""
    if resumed:
        rank_zero_info(f"stagesafe: the optimizer continues from the state beside {uri} (moments, step counts)")
    else:
        rank_zero_info(
            f"stagesafe: {uri} holds weights only: the optimizer starts afresh from them (a handoff written by "
            "`stagesafe consolidate --optimizer` carries its state)"
        )


def boundary_line(report: BoundaryReport, *, waited: bool, failed: tuple[str, BaseException] | None = None) -> str:
    """One line for a stage's boundary: how long it took, and whether the handoff was written. ``failed``: the
    URL and error of a write that failed and that no commit since has made good: the line says so."""
    if failed is not None:
        uri, error = failed
        clean = "" if report.clean else f"; NOT clean: {report.stale_problems}"
        return (
            f"stagesafe: {report.stage} boundary {report.seconds:.2f}s; handoff write FAILED at {uri} "
            f"({describe(error)}): it does not hold the module's weights{clean}"
        )
    if report.wrote and not waited:
        written = "being written in the background"
    else:
        written = "written" if report.wrote else "unchanged"
    size = f" ({megabytes(report.handoff_bytes)})" if report.handoff_bytes else ""
    clean = "" if report.clean else f"; NOT clean: {report.stale_problems}"
    return f"stagesafe: {report.stage} boundary {report.seconds:.2f}s; handoff {written} at {report.uri}{size}{clean}"


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def warn_if_fit_has_nothing_left(trainer: "pl.Trainer") -> bool:
    """Lightning's ``fit`` on a Trainer that already reached its ``max_epochs``/``max_steps`` returns at once
    without training; users who reuse one Trainer across stages meet that silently. Returns whether it warned."""
    loop = trainer.fit_loop
    if trainer.state.fn != TrainerFn.FITTING or trainer.ckpt_path is not None:
        return False
    steps = loop.max_steps not in (None, -1) and loop.epoch_loop.global_step >= loop.max_steps
    epochs = loop.max_epochs not in (None, -1) and loop.epoch_progress.current.processed >= loop.max_epochs
    if steps or epochs:
        limit = f"max_steps={loop.max_steps}" if steps else f"max_epochs={loop.max_epochs}"
        rank_zero_warn(
            f"this Trainer has already trained to {limit}: fit will return without a step. To train on, raise "
            f"trainer.fit_loop.{'epoch_loop.max_steps' if steps else 'max_epochs'} before calling fit, or use a new "
            "Trainer (the module keeps its weights across Trainers)"
        )
    return steps or epochs


def say_unchanged(uri: str) -> None:
    """Rank 0's line, at Lightning's default level, after a ``fit`` that made no optimizer step and whose handoff
    already held the module's weights: nothing was written."""
    rank_zero_info(f"stagesafe: fit made no optimizer step; the weights are unchanged and the handoff at {uri} "
                   "already holds them: not written again")
