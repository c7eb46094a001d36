"""The strategy's collectives, each inside the guard of :mod:`~stagesafe.stages.collective_guard`: Lightning's
``barrier``, ``broadcast``, ``reduce``, ``all_gather`` and ``reduce_boolean_decision`` wait for the handoff
writers' device work first (their copies would queue behind the collective), and after a call that some rank
left elsewhere the ranks meet through the job's key-value store before the collective."""

from __future__ import annotations

import contextlib
from typing import Any

from typing_extensions import override

from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy
from stagesafe.stages.call_series import CallSeries

__all__ = ["GuardedCollectives"]


class GuardedCollectives(CPUCapableDeepSpeedStrategy):
    """Lightning's DeepSpeed strategy whose collectives go through the guard of its :class:`CallSeries`."""

    call_series: CallSeries  # what the strategy's Trainer calls share, the guard of their collectives among it

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._collective():
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._collective():
            return super().broadcast(obj, src)

    @override
    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        with self._collective():
            return super().reduce(*args, **kwargs)

    @override
    def all_gather(self, *args: Any, **kwargs: Any) -> Any:
        with self._collective():
            return super().all_gather(*args, **kwargs)

    @override
    def reduce_boolean_decision(self, *args: Any, **kwargs: Any) -> bool:
        with self._collective():
            return super().reduce_boolean_decision(*args, **kwargs)

    def _collective(self) -> contextlib.AbstractContextManager[None]:
        """No collective while a writer needs the device; after a failed call the ranks meet first."""
        return self.call_series.collective(self.lightning_module)

