"""StageSafeDeepSpeedStrategy's arguments, checked when it is built (no processes needed)."""

from __future__ import annotations

import copy

import pytest

from stagesafe import StageSafeDeepSpeedStrategy


def test_the_users_config_dict_is_copied_not_kept():
    config = {"zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    original = copy.deepcopy(config)
    strategy = StageSafeDeepSpeedStrategy(config=config)
    strategy.config["gradient_accumulation_steps"] = 1  # what Lightning does to it at setup
    assert config == original


@pytest.mark.parametrize("name", ["handoff_uri", "resume_from"])
def test_urls_must_be_strings(name):
    with pytest.raises(TypeError, match=f"{name} must be a str URL or path"):
        StageSafeDeepSpeedStrategy(stage=3, **{name: 42})


def test_restore_mode_is_checked():
    with pytest.raises(ValueError, match="choose 'cpu'"):
        StageSafeDeepSpeedStrategy(stage=3, restore="gpu")
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        StageSafeDeepSpeedStrategy(stage=2, restore="meta")
    assert StageSafeDeepSpeedStrategy(stage=3, restore="meta").restore_mode == "meta"
