"""stages/stage_entry.py: what a stage's entry checks and reads before any engine, on one process (no process
group: each collective is this rank's alone). Real files, the real writer and key-value store."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

import stagesafe
from _tensors import assert_bitwise_equal
from stagesafe.errors import HandoffNotFoundError, InvalidArgumentError, StaleDeepSpeedStateError
from stagesafe.stages.channel import JobChannel
from stagesafe.stages.history import HandoffTarget, fingerprint, history_of, state_tensors
from stagesafe.stages.stage_entry import assert_clean, build_from_handoff, check_still_there, first_stage
from stagesafe.stages.writer import HandoffWriter


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _writer(uri: str = "memory://unused") -> HandoffWriter:
    channel = JobChannel(dist.HashStore(), rank=0, world=1, prefix="entry", timeout=30.0)
    return HandoffWriter(channel, uri, writers=1, timeout=30.0)


def _written(module: nn.Module, uri: str) -> HandoffTarget:
    """The module's weights committed at ``uri``, and its history saying so."""
    stagesafe.save_state_dict(dict(module.state_dict()), uri)
    target = HandoffTarget(uri=uri)
    _, history = first_stage(module, state_tensors(module), resume_from=None, target=target, on_meta=False,
                             weights_from={})
    history.target, history.fingerprint = target, fingerprint(state_tensors(module))
    return target


def test_a_clean_module_passes_and_one_with_an_earlier_engines_attributes_is_refused_saying_what_to_do():
    module = _net()
    assert_clean(module)
    module[0].weight.ds_id = 3
    with pytest.raises(StaleDeepSpeedStateError, match=r"'0.weight' carries DeepSpeed attributes.*stagesafe.restore"):
        assert_clean(module)
    assert_clean(module, fresh={id(module[0].weight)})  # zero.Init built it in this call: not stale


def test_a_first_stage_without_resume_from_starts_the_history_naming_this_call(tmp_path):
    module = _net()
    tensors = state_tensors(module)
    got, history = first_stage(module, tensors, resume_from=None, target=HandoffTarget(str(tmp_path / "h")),
                               on_meta=False, weights_from={"stage": "fit", "global_step": 0})
    assert got is tensors and history_of(module) is history
    assert history.weights_from == {"stage": "fit", "global_step": 0} and history.target is None


def test_a_first_stage_takes_resume_froms_weights_into_the_same_parameter_objects(tmp_path):
    source = str(tmp_path / "earlier")
    saved = {n: v + 1 for n, v in _net().state_dict().items()}
    stagesafe.save_state_dict(saved, source)
    module = _net()
    weight = module[0].weight
    _, history = first_stage(module, state_tensors(module), resume_from=HandoffTarget(source),
                             target=HandoffTarget(str(tmp_path / "h")), on_meta=False, weights_from={"stage": "fit"})
    assert module[0].weight is weight
    assert_bitwise_equal(dict(module.state_dict()), saved)
    assert history.weights_from == {"resumed_from": source}


def test_a_handoff_deleted_since_is_written_again_by_a_module_with_weights(tmp_path, caplog):
    module, uri = _net(), str(tmp_path / "h")
    target = _written(module, uri)
    history = history_of(module)
    check_still_there(history, target, _writer(), on_meta=False)
    assert history.target == target  # there, whole: nothing to do
    shutil.rmtree(uri)
    check_still_there(history, target, _writer(), on_meta=False)
    assert history.fingerprint is None and "this stage writes the module's weights there again" in caplog.text


def test_a_module_of_meta_tensors_whose_handoff_is_gone_is_refused_naming_the_way_out(tmp_path):
    module, uri = _net(), str(tmp_path / "h")
    target = _written(module, uri)
    shutil.rmtree(uri)
    with pytest.raises(HandoffNotFoundError, match="resume from another copy"):
        check_still_there(history_of(module), target, _writer(), on_meta=True)


def test_a_meta_modules_engine_is_built_from_its_handoff_and_one_without_a_handoff_is_refused(tmp_path):
    module, uri = _net(), str(tmp_path / "h")
    _written(module, uri)
    seen = {}
    reader = build_from_handoff(history_of(module), _writer(), lambda values: seen.update(values.items()))
    assert_bitwise_equal(seen, dict(module.state_dict()))
    assert reader.keys() == seen.keys()
    other = _net()
    first_stage(other, state_tensors(other), resume_from=None, target=HandoffTarget(uri), on_meta=False,
                weights_from={})
    with pytest.raises(InvalidArgumentError, match="no handoff holds its weights: pass resume_from=URI"):
        build_from_handoff(history_of(other), _writer(), lambda values: None)
