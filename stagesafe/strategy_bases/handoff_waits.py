"""The handoff's write as the user sees it: waited for as a Trainer call returns (``wait_for_write=True``) or
when asked (:meth:`~HandoffWaits.wait_for_handoff`), its failure said on every rank until a write commits or it
is acknowledged, and the boundary's log line. :class:`StageReturned` is the Trainer's last hook of a call, which
tells the strategy that the call is returning."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from stagesafe.boundary_report import BoundaryReport
from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy
from stagesafe.errors import HandoffNotReadyError, describe
from stagesafe.stages.call_series import CallSeries
from stagesafe.trainer_messages import boundary_line

__all__ = ["HandoffWaits", "StageReturned"]

log = logging.getLogger("stagesafe.strategy")  # the strategy's logger: its lines keep their name


class HandoffWaits(CPUCapableDeepSpeedStrategy):
    """Lightning's DeepSpeed strategy whose Trainer calls may return before their handoff is written."""

    call_series: CallSeries  # what the strategy's Trainer calls share: its writer and last report among it
    wait_for_write: bool

    @property
    def last_boundary(self) -> Optional[BoundaryReport]:
        """The report of the last Trainer call's boundary (None before the first call ended): its stage, the
        handoff's URL, seconds spent leaving and entering, seconds per phase, whether it wrote the handoff,
        and whether the module came back clean. A background write adds its phases once it is done."""
        return self.call_series.last_report

    def wait_for_handoff(self) -> None:
        """Return once the last stage's handoff is committed (raise its failure on every rank). Call it on
        every rank, e.g. before another process reads the handoff. Once a write failed, every later call
        raises :class:`~stagesafe.HandoffNotReadyError` until a write commits or
        :meth:`acknowledge_handoff_failure` is called: the folder does not hold the module's weights."""
        try:
            self.call_series.join(self.lightning_module)
        finally:
            if self.last_boundary is not None:
                self._log_boundary(self.last_boundary, waited=True)
        failed = self._handoff_failure()
        if failed is not None:
            uri, error = failed
            raise HandoffNotReadyError(
                f"the last handoff write to {uri!r} failed ({describe(error)}): the folder holds the handoff "
                "committed before it, if any, not the module's weights. The next Trainer call writes them again; "
                "or call strategy.acknowledge_handoff_failure() to go on without them"
            ) from error

    def acknowledge_handoff_failure(self) -> None:
        """Go on after a failed handoff write: ``wait_for_handoff()`` and the boundary's log line stop saying
        it (on this rank: call it on every rank). The module keeps its weights; the next call writes them.
        The last boundary's report then says what the folder holds: no write of that stage (``wrote=False``)."""
        series = self.call_series
        failed = series.acknowledge(self.lightning_module)
        if failed is not None and series.last_report is not None and series.last_report.uri == failed[0]:
            series.last_report = dataclasses.replace(series.last_report, wrote=False)

    def _handoff_failure(self) -> tuple[str, BaseException] | None:
        return self.call_series.failure(self.lightning_module)

    def _log_boundary(self, report: BoundaryReport, *, waited: bool) -> None:
        if self.is_global_zero:
            log.info("%s", boundary_line(report, waited=waited, failed=self._handoff_failure()))

    def _stage_returned(self) -> None:
        """The Trainer call is about to return: join the write if asked to, else only report the boundary."""
        self.call_series.call_returned(self.lightning_module)  # Lightning's teardown is over
        if self.wait_for_write:
            self.wait_for_handoff()
        elif self.last_boundary is not None:
            self._log_boundary(self.last_boundary, waited=False)


class StageReturned(Callback):
    """The Trainer's last hook of a call (after the strategy's teardown): the call is returning."""

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, HandoffWaits):
            strategy._stage_returned()
