"""cpu_strategy.py: Lightning's DeepSpeed strategy, able to run on CPU processes (gloo) when the user asks for
DeepSpeed's CPU accelerator."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy

from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy, cpu_requested, use_deepspeed_cpu_accelerator


def test_the_cpu_is_requested_by_ds_accelerator_only(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert cpu_requested()
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert not cpu_requested()
    monkeypatch.delenv("DS_ACCELERATOR")
    assert not cpu_requested()


def test_deepspeed_runs_on_the_cpu_once_asked():
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator, set_accelerator

    before = get_accelerator()
    try:
        use_deepspeed_cpu_accelerator()
        assert get_accelerator().device_name() == "cpu"
        use_deepspeed_cpu_accelerator()  # again: nothing changes
        assert get_accelerator().device_name() == "cpu"
    finally:
        set_accelerator(before)


def test_it_is_lightnings_deepspeed_strategy_with_its_arguments():
    strategy = CPUCapableDeepSpeedStrategy(stage=3)
    assert isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3
