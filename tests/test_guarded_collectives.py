"""strategy_bases/guarded_collectives.py: Lightning's five collectives of the strategy, each inside the guard of its calls, in
this process (no process group: Lightning's own collectives return at once). Each first waits for the writers'
device work; once a call failed on some rank, a collective that fails says the process group is broken."""

from __future__ import annotations

import pytest
import torch

from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy
from stagesafe.errors import DistributedStageError
from stagesafe.stages.call_series import CallSeries
from stagesafe.stages.channel import Ending
from stagesafe.strategy_bases.guarded_collectives import GuardedCollectives

pytestmark = pytest.mark.timeout(60)


class _Writer:
    """What the guard asks of a writer: wait for its device work (counted here)."""

    def __init__(self) -> None:
        self.waits = 0

    def wait_device(self) -> None:
        self.waits += 1


class _Strategy(GuardedCollectives):
    def __init__(self) -> None:
        super().__init__(parallel_devices=[torch.device("cpu")])
        self.call_series = CallSeries(storage_options=None, resume_from=None, overwrite=False)


@pytest.mark.parametrize("call", [
    lambda s: s.barrier("name"),
    lambda s: s.broadcast("obj"),
    lambda s: s.reduce(torch.ones(2)),
    lambda s: s.all_gather(torch.ones(2)),
    lambda s: s.reduce_boolean_decision(True),
])
def test_every_collective_waits_for_the_writers_device_work_first(call):
    strategy, writer = _Strategy(), _Writer()
    strategy.call_series.writer = writer  # type: ignore[assignment] - what the guard asks of it
    call(strategy)
    assert writer.waits >= 1


def test_the_collectives_give_what_lightnings_give():
    strategy = _Strategy()
    assert strategy.broadcast({"a": 1}) == {"a": 1}
    assert torch.equal(strategy.all_gather(torch.arange(3)), torch.arange(3))
    assert strategy.reduce_boolean_decision(True) is True


def test_once_a_call_failed_on_a_rank_a_failing_collective_names_the_broken_group(monkeypatch):
    strategy = _Strategy()
    strategy.call_series.guard.call_ended(Ending(gather=True, failed=(1,), absent=()))

    def broken(self, *args, **kwargs):
        raise RuntimeError("gloo: connection closed by peer")

    monkeypatch.setattr(CPUCapableDeepSpeedStrategy, "barrier", broken)
    with pytest.raises(DistributedStageError, match=r"process group is broken.*rank\(s\) \[1\]"):
        strategy.barrier()
