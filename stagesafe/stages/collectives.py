"""Small collective helpers: who am I, and make one rank's failure every rank's failure.

A stage boundary does I/O on one rank while the others wait; if that rank fails silently the others hang
in the next collective. Every helper here ends with all ranks knowing the outcome (the pattern of
torch.distributed.checkpoint's ``_DistWrapper``).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

from stagesafe.errors import DistributedStageError

__all__ = ["rank", "world_size", "barrier", "on_rank_zero", "all_ranks"]

T = TypeVar("T")


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    return dist.get_world_size() if _active() else 1


def barrier() -> None:
    if _active():
        dist.barrier()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def on_rank_zero(fn: Callable[[], T], what: str) -> T | None:
    """Run ``fn`` on rank 0 only and return its (small, picklable) result on every rank; if it raises, raise
    on every rank (rank 0 re-raises its own error)."""
    result, error = None, None
    if rank() == 0:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
    if _active():
        box = [(None, result) if error is None else (_describe(error), None)]
        dist.broadcast_object_list(box, src=0)
        failure, result = box[0]
        if failure is not None and error is None:
            raise DistributedStageError(f"{what} failed on rank 0: {failure}")
    if error is not None:
        raise error
    return result


def all_ranks(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on every rank; if any rank raises, raise on every rank naming each failure."""
    result, error = None, None
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - reported to every rank below
        error = exc
    if _active():
        outcomes: list[str | None] = [None] * world_size()
        dist.all_gather_object(outcomes, None if error is None else _describe(error))
        failed = {r: o for r, o in enumerate(outcomes) if o is not None}
        if failed and error is None:
            lines = "; ".join(f"rank {r}: {o}" for r, o in sorted(failed.items()))
            raise DistributedStageError(f"{what} failed on {len(failed)} rank(s): {lines}")
    if error is not None:
        raise error
    return result  # type: ignore[return-value]
