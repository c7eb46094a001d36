"""Collectives on the main thread: who am I, and one rank's failure made every rank's failure.

Ranks coordinate in two ways, and one rule says which (docs/how-it-works.md, "The package, and how ranks
coordinate"):

- **Collectives** (this module; ``zero/``'s gathers) only on the main thread, at a point every rank reaches in
  step (the same collectives in the same order, decided before, never by what one rank alone saw), and only
  once this rank's writer needs the device no more (``HandoffWriter.wait_device()``).
- **The job's key-value store** (:mod:`stagesafe.stages.channel`) for everything else: whatever a background
  write agrees on, anything off the main thread, and any point the ranks may reach out of step (the end of a
  Trainer call that failed on some rank). Every wait there is bounded by the strategy's timeout.

Each helper here ends with every rank knowing every rank's outcome (torch.distributed.checkpoint's
``_DistWrapper``): a rank that fails raises its own error, the others a :class:`DistributedStageError` whose
``failures`` maps each failed rank to what it reported. A ``fn`` that enters collectives itself must enter
all of them on every rank even when it fails; otherwise the others meet its failure only at the timeout.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

from stagesafe.errors import DistributedStageError, describe

__all__ = ["is_up", "rank", "world_size", "on_rank_zero", "all_ranks", "gather_all"]

T = TypeVar("T")


def is_up() -> bool:
    """A process group is up: the collectives here reach the other ranks."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_up() else 0


def world_size() -> int:
    return dist.get_world_size() if is_up() else 1


def _attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``fn()``'s result, or what it raised. An interrupt (Ctrl+C, ``SystemExit``) is caught too: the other
    ranks are told of it in the collective that follows, then it is raised here, instead of leaving them in
    that collective until the timeout."""
    try:
        return fn(), None
    except BaseException as exc:  # noqa: BLE001 - an interrupt on one rank is reported to every rank
        return None, exc


def _gathered(value: T) -> list[T]:
    """Every rank's ``value`` (small, picklable), in rank order, on every rank."""
    if not is_up():
        return [value]
    values: list = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def _raise_failures(what: str, reports: list[str | None], own: BaseException | None) -> None:
    """Raise this rank's own error, else a :class:`DistributedStageError` naming every rank that failed."""
    if own is not None:
        raise own
    failures = {r: report for r, report in enumerate(reports) if report is not None}
    if failures:
        lines = "; ".join(f"rank {r}: {report}" for r, report in sorted(failures.items()))
        raise DistributedStageError(f"{what} failed on {len(failures)} rank(s): {lines}", failures=failures)


def on_rank_zero(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on rank 0 only and return its (small, picklable) result on every rank; if it raises, raise
    on every rank (rank 0 re-raises its own error, the others a :class:`DistributedStageError` naming it)."""
    result, error = _attempt(fn) if rank() == 0 else (None, None)
    if is_up():
        box = [(None, result) if error is None else (describe(error), None)]
        dist.broadcast_object_list(box, src=0)
        failure, result = box[0]
        if failure is not None and error is None:
            raise DistributedStageError(f"{what} failed on rank 0: {failure}", failures={0: failure})
    if error is not None:
        raise error
    return result  # type: ignore[return-value]


def all_ranks(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on every rank and return this rank's result (never sent: it may be large); if any rank
    raises, raise on every rank naming each failure."""
    result, error = _attempt(fn)
    _raise_failures(what, _gathered(None if error is None else describe(error)), error)
    return result  # type: ignore[return-value]


def gather_all(fn: Callable[[], T], what: str) -> list[T]:
    """Run ``fn`` on every rank and return every rank's (small, picklable) result, in rank order, on every
    rank; if any rank raises, raise on every rank naming each failure."""
    result, error = _attempt(fn)
    outcomes = _gathered((None, result) if error is None else (describe(error), None))
    _raise_failures(what, [report for report, _ in outcomes], error)
    return [value for _, value in outcomes]
