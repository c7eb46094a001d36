"""strategy_bases/checkpoint_hooks.py: the strategy's checkpoint hooks, in this process without a Trainer call.
The engine asked for after a call is gone, and the error says where the weights are; a ``ckpt_path`` folder written
between calls is read back whole, weights and client state; ``storage_options`` is refused as stock refuses it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stagesafe.boundary_report import BoundaryReport
from stagesafe.errors import EngineReleasedError
from stagesafe.stages.call_series import CallSeries
from stagesafe.strategy_bases.checkpoint_hooks import CheckpointHooks
from stagesafe.zero.checkpoint_writer import write_zero_checkpoint

pytestmark = pytest.mark.timeout(120)


class _Strategy(CheckpointHooks):
    def __init__(self) -> None:
        super().__init__(stage=3)
        self.call_series = CallSeries(storage_options=None, resume_from=None, overwrite=False)


def test_the_engine_is_none_before_the_first_call_and_released_after_a_call():
    strategy = _Strategy()
    assert strategy.deepspeed_engine is None
    strategy.call_series.calls = 1
    strategy.call_series.last_report = BoundaryReport(stage="fit", uri="/tmp/run/stagesafe_handoff")
    with pytest.raises(EngineReleasedError, match=r"destroyed .* the handoff at '/tmp/run/stagesafe_handoff'"):
        strategy.deepspeed_engine


def test_a_checkpoint_written_between_calls_is_read_back_whole(tmp_path):
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    path = str(tmp_path / "ckpt")
    write_zero_checkpoint(path, module, zero_stage=3, client_state={"epoch": 4})
    loaded = _Strategy().load_checkpoint(path)
    assert loaded["epoch"] == 4
    assert loaded["state_dict"].keys() == module.state_dict().keys()
    for name, value in module.state_dict().items():
        assert torch.equal(loaded["state_dict"][name], value), name


def test_storage_options_between_calls_are_refused_as_stock_refuses_them(tmp_path):
    with pytest.raises(TypeError, match="storage_options.*is not supported"):
        _Strategy().save_checkpoint({}, str(tmp_path / "ckpt"), storage_options={"a": 1})
