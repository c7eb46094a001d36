"""How the steps of a stage's exit run: every step is tried, the first failure is raised once the module is
plain again, and each step's seconds are recorded for the boundary's report."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["FirstFailure", "PhaseClock", "no_collector_passes"]

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


@contextlib.contextmanager
def no_collector_passes() -> Iterator[None]:
    """A boundary makes and drops a few objects per tensor, freed by their reference counts. With tens of
    thousands of tensors that is enough allocations to start the cyclic collector's full passes over the whole
    heap (every tensor, DeepSpeed's attributes on every parameter): seconds at 20,000 tensors, for nothing to
    collect. The collector is paused for the boundary's steps and resumed as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
