"""How the steps of a stage's exit run: every step is tried, the first failure is raised once the module is
plain again, and each step's seconds are recorded for the boundary's report."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["FirstFailure", "PhaseClock"]

T = TypeVar("T")


class FirstFailure:
    """The first failure among an exit's steps, raised once the module is plain again.

    It catches ``BaseException``: a Ctrl+C (``KeyboardInterrupt``) in the middle of a step must still leave the
    engine destroyed and the module holding plain tensors before it is re-raised, as any other failure does.
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def attempt(self, step: Callable[[], T]) -> T | None:
        """``step()``'s result, or None once its failure is noted."""
        try:
            return step()
        except BaseException as exc:  # noqa: BLE001 - a cleanup runs before a Ctrl+C is re-raised (see above)
            self.error = self.error or exc
            return None

    def raise_first(self) -> None:
        if self.error is not None:
            raise self.error


class PhaseClock:
    """Records the seconds since the previous mark under each phase name."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into = into
        self.last = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = now - self.last
        self.last = now
