"""stages/between_calls.py: what a checkpoint written between Trainer calls holds. The kept engine state only
while it belongs to the module's weights, and each of the four reasons it does not, said; a module of meta
tensors saved from its handoff, refused while that handoff is written or when none holds it."""

from __future__ import annotations

import pytest
import torch
from _tensors import assert_bitwise_equal

from stagesafe.errors import HandoffNotReadyError, InvalidArgumentError
from stagesafe.publishing.save import save_state_dict
from stagesafe.stages.between_calls import has_meta_tensors, kept_training, weights_between_calls
from stagesafe.stages.history import HandoffTarget, KeptTraining, fingerprint, new_history, state_tensors


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _kept(module, **fields) -> KeptTraining:
    return KeptTraining(fingerprint=fingerprint(state_tensors(module)), **fields)


def test_the_kept_state_is_given_while_it_belongs_to_the_modules_weights():
    module = _module()
    kept = new_history(module).kept = _kept(module, checkpoint={"mp_rank_00_model_states.pt": {}}, world_size=2)
    assert kept_training(module, world_size=2) == (kept, "")


def test_a_module_no_fit_trained_has_none_and_says_why():
    module = _module()
    kept, why = kept_training(module, world_size=1)
    assert kept is None and "no fit under StageSafeDeepSpeedStrategy" in why
    new_history(module)  # a stage ran, no fit kept anything
    assert kept_training(module, world_size=1) == (None, why)


def test_a_fit_that_kept_no_checkpoint_says_its_own_reason():
    module = _module()
    new_history(module).kept = _kept(module, missing="keep_optimizer_state=False was passed")
    assert kept_training(module, world_size=1) == (None, "keep_optimizer_state=False was passed")


def test_weights_changed_since_the_fit_leave_its_optimizer_state_behind():
    module = _module()
    new_history(module).kept = _kept(module, checkpoint={"f": {}})
    with torch.no_grad():
        module.weight.add_(1.0)  # in place: the same tensor, a newer version
    kept, why = kept_training(module, world_size=1)
    assert kept is None and "changed since the last fit ended" in why


def test_another_world_size_is_refused_naming_both():
    module = _module()
    new_history(module).kept = _kept(module, checkpoint={"f": {}}, world_size=2)
    kept, why = kept_training(module, world_size=4)
    assert kept is None and "2 rank(s)" in why and "4" in why


def test_a_module_holding_its_weights_needs_nothing_from_the_handoff():
    module = _module()
    assert not has_meta_tensors(module) and weights_between_calls(module, []) is None


def test_a_meta_module_is_saved_from_its_handoff_bitwise(tmp_path):
    weights = state_tensors(_module())
    uri = str(tmp_path / "handoff")
    save_state_dict(weights, uri)
    module = _module().to("meta")
    new_history(module).target = HandoffTarget(uri)
    assert has_meta_tensors(module)
    assert_bitwise_equal(dict(weights_between_calls(module, [])), weights)


def test_a_meta_module_whose_weights_no_handoff_holds_is_refused_saying_what_to_do():
    module = _module().to("meta")
    with pytest.raises(InvalidArgumentError, match=r"stagesafe.restore\(module, uri\)"):
        weights_between_calls(module, [])


def test_a_meta_module_whose_handoff_is_still_being_written_is_refused_saying_what_to_do(tmp_path):
    uri = str(tmp_path / "handoff")
    module = _module().to("meta")
    new_history(module).target = HandoffTarget(uri)

    class Writing:  # the one attribute the check reads of a HandoffWriter
        pending_uri = uri

    with pytest.raises(HandoffNotReadyError, match=r"wait_for_handoff\(\)"):
        weights_between_calls(module, [Writing()])
