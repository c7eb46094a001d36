"""strategy_arguments.py: the strategy's own arguments, checked when it is built, each refusal naming the value
and what to pass instead. (The strategy built with them: tests/test_strategy.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from _handoffs import url

from stagesafe.errors import HandoffNotFoundError, InvalidArgumentError, StorageBackendError
from stagesafe.publishing.save import save_state_dict
from stagesafe.strategy_arguments import (
    check_between_stages,
    check_keywords,
    check_local_handoff,
    check_positional,
    check_zero_stage,
    checked_storage_options,
    checked_url,
    inference_config,
)


class _Accelerator:
    pass


def test_a_misspelt_keyword_names_the_owner_and_the_one_meant():
    check_keywords({"handoff_uri": "x"}, ["self", "handoff_uri", "stage"], owner="S")
    with pytest.raises(TypeError, match=r"S\(\) got an unexpected keyword argument 'handof_uri'; did you mean 'handoff_uri'"):
        check_keywords({"handof_uri": "x"}, ["handoff_uri", "stage"], owner="S")


def test_only_an_accelerator_may_be_positional_and_a_stage_number_says_how_to_pass_it():
    check_positional((), ["accelerator", "zero_optimization", "stage"], owner="S", accelerator=_Accelerator)
    check_positional((None,), ["accelerator"], owner="S", accelerator=_Accelerator)
    check_positional((_Accelerator(),), ["accelerator"], owner="S", accelerator=_Accelerator)
    with pytest.raises(TypeError, match=r"would land in DeepSpeedStrategy's accelerator=3; for ZeRO stage 3 pass stage=3"):
        check_positional((3,), ["accelerator", "zero_optimization"], owner="S", accelerator=_Accelerator)


@pytest.mark.parametrize("value", [4, -1, True, "3", 2.0, None])
def test_a_zero_stage_is_0_to_3_as_an_int(value):
    with pytest.raises(InvalidArgumentError, match="is not a ZeRO stage"):
        check_zero_stage(value, where="config['zero_optimization']['stage']")
    for stage in (0, 1, 2, 3):
        check_zero_stage(stage)


def test_storage_options_are_a_dict_copied():
    options = {"anon": True}
    assert checked_storage_options(options) == options and checked_storage_options(options) is not options
    assert checked_storage_options(None) == {}
    with pytest.raises(TypeError, match="storage_options must be a dict"):
        checked_storage_options(["anon"])


def test_a_url_is_checked_without_reading_it(tmp_path):
    assert checked_url("handoff_uri", None, {}) is None
    assert checked_url("handoff_uri", tmp_path / "new", {}) == str(tmp_path / "new")  # a path becomes its str
    with pytest.raises(TypeError, match="handoff_uri must be a str URL"):
        checked_url("handoff_uri", 3, {})
    with pytest.raises(StorageBackendError):
        checked_url("handoff_uri", "nosuchprotocol://bucket/run", {})
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="is a file, not a folder"):
        checked_url("handoff_uri", str(tmp_path / "file"), {})


def test_a_local_resume_from_must_hold_a_committed_handoff(tmp_path, url):
    with pytest.raises(HandoffNotFoundError, match="there is no such folder"):
        check_local_handoff("resume_from", str(tmp_path / "missing"), {})
    (tmp_path / "empty").mkdir()
    with pytest.raises(HandoffNotFoundError, match="holds no committed handoff.*stagesafe consolidate"):
        check_local_handoff("resume_from", str(tmp_path / "empty"), {})
    save_state_dict({"w": torch.zeros(2)}, url)
    check_local_handoff("resume_from", url, {})
    check_local_handoff("resume_from", "memory://not/looked/at/now", {})  # read at the first stage


def test_between_stages_is_cpu_or_meta_and_meta_needs_zero_3():
    check_between_stages("cpu", zero_stage_3=False)
    check_between_stages("meta", zero_stage_3=True)
    check_between_stages("meta", zero_stage_3=None)  # a config file: checked once it is read
    with pytest.raises(InvalidArgumentError, match="choose 'cpu'"):
        check_between_stages("gpu", zero_stage_3=True)
    with pytest.raises(InvalidArgumentError, match="needs ZeRO stage 3"):
        check_between_stages("meta", zero_stage_3=False)


def test_the_inference_config_keeps_precision_and_partitioning_and_leaves_the_users_config_alone():
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam"},
              "train_micro_batch_size_per_gpu": 8}
    before = copy.deepcopy(config)
    inference = inference_config(config, zero_stage_3=True)
    assert inference == {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                         "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3}}
    inference["zero_optimization"]["stage"] = 0
    assert config == before
    assert inference_config({"fp16": {"enabled": True}}, zero_stage_3=False) == {
        "train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}}
