"""stages/history.py: what stagesafe remembers of a module between Trainer calls, on real modules and tensors, and
what a boundary keeps of the engine (``KeptTraining``): which fp32 masters still hold for the tensors it finds."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from stagesafe.stages.history import (
    HandoffTarget,
    KeptTraining,
    ModuleHistory,
    fingerprint,
    history_of,
    new_history,
    state_tensors,
)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.BatchNorm1d(3)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


class _Writer:
    """Stands for the writer a history points at: the history holds it weakly."""


def test_state_tensors_are_the_state_dicts_own_tensors_detached():
    module = _Tied()
    tensors = state_tensors(module)
    assert list(tensors) == list(module.state_dict())  # tied names both, buffers too, non-persistent ones not
    assert tensors["head.weight"].data_ptr() == tensors["embed.weight"].data_ptr() == module.embed.weight.data_ptr()
    assert not any(t.requires_grad for t in tensors.values())
    assert tensors["norm.num_batches_tracked"].dtype == torch.int64


def test_a_fingerprint_changes_with_an_in_place_change_or_another_tensor_and_only_then():
    tensors = {"a": torch.zeros(3), "b": torch.ones(2)}
    before = fingerprint(tensors)
    assert fingerprint(tensors) == before and fingerprint({**tensors}) == before
    tensors["b"].mul_(1)  # in place, even to equal values: a new version
    assert fingerprint(tensors)["b"] != before["b"] and fingerprint(tensors)["a"] == before["a"]
    assert fingerprint({**tensors, "a": torch.zeros(3)})["a"] != before["a"]  # equal values, another tensor


def test_a_handoff_holds_the_weights_it_was_written_with_until_they_change_or_it_is_lost():
    module = nn.Linear(2, 2)
    history, target = ModuleHistory(original={}), HandoffTarget(uri="memory://handoff")
    writer = _Writer()
    assert not history.holds(target, state_tensors(module)) and history.writer is None
    history.written(target, state_tensors(module), writer)
    assert history.holds(target, state_tensors(module)) and history.writer is writer
    assert not history.holds(HandoffTarget(uri="memory://elsewhere"), state_tensors(module))
    assert not history.holds(HandoffTarget(uri="memory://handoff", storage_options={"a": 1}), state_tensors(module))
    with torch.no_grad():
        module.weight.add_(1)
    assert not history.holds(target, state_tensors(module))
    history.written(target, state_tensors(module), writer)
    history.lost()
    assert not history.holds(target, state_tensors(module)) and history.target == target
    del writer
    gc.collect()
    assert history.writer is None  # a history does not keep a writer alive


def test_each_name_keeps_the_dtype_and_device_it_had_first():
    history = ModuleHistory(original={})
    history.note_names({"w": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2)})
    history.note_names({"w": torch.zeros(2), "new": torch.zeros(2, dtype=torch.float16, device="meta"),
                        "built": torch.zeros(2, device="meta")}, fresh={"built"})
    assert history.original == {
        "w": (torch.bfloat16, torch.device("cpu")),  # not the dtype it has now
        "new": (torch.float16, torch.device("meta")),  # a name new to the module takes its own
        "built": (torch.float32, torch.device("cpu")),  # zero.Init's: the CPU between stages
    }  # "b" is gone from the module: forgotten


def test_a_modules_history_is_its_own_and_goes_with_it():
    module, other = nn.Linear(2, 2), nn.Linear(2, 2)
    assert history_of(module) is None
    history = new_history(module)
    assert history_of(module) is history and history_of(other) is None
    assert history.original == {} and history.target is None and history.fingerprint is None
    gone = weakref.ref(history)
    del module, history
    gc.collect()
    assert gone() is None


# -- what a boundary keeps of the engine -----------------------------------------------------------------------------


def _kept(tensors: dict[str, torch.Tensor], masters: dict[str, torch.Tensor]) -> KeptTraining:
    return KeptTraining(fingerprint(tensors), masters=masters)


def test_masters_are_given_only_for_tensors_unchanged_since_they_were_kept():
    tensors = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.bfloat16)}
    masters = {"a": torch.full((3,), 0.1), "b": torch.full((2,), 0.2)}
    kept = _kept(tensors, masters)
    assert set(kept.masters_for(tensors)) == {"a", "b"} and kept.holds(tensors)
    tensors["b"].add_(1)  # in place: a new version
    assert set(kept.masters_for(tensors)) == {"a"}
    assert not kept.holds(tensors)
    replaced = {**tensors, "a": torch.zeros(3, dtype=torch.bfloat16)}  # another tensor object
    assert kept.masters_for(replaced) == {}


def test_a_kept_state_outdated_by_a_step_gives_no_masters_and_holds_no_weights():
    tensors = {"a": torch.zeros(3, dtype=torch.bfloat16)}
    kept = _kept(tensors, {"a": torch.full((3,), 0.1)})
    kept.outdated("a step")  # the given-back optimizer stepped on its state: the tensors' versions need not move
    assert kept.masters_for(tensors) == {} and not kept.holds(tensors) and kept.outdated_by == "a step"
    kept.moved(fingerprint(tensors), {"a": torch.empty(3, device="meta")})
    assert kept.fingerprint == {}  # a move by stagesafe does not make it valid again


def test_dropping_a_kept_state_empties_the_given_back_optimizers_views_into_it():
    from stagesafe.zero.engine import OptimizerViews

    param = nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param])
    flat = torch.ones(5)
    kept = _kept({"a": param.detach()}, {})
    kept.checkpoint = {"optim.pt": {"state": {0: {"exp_avg": flat}}}}
    kept.views = OptimizerViews(optimizer, {param: {"exp_avg": flat[:3]}}, {}, on_step=lambda: kept.outdated("a step"))
    kept.drop_views()
    assert len(optimizer.state) == 0 and kept.views is None and kept.checkpoint is not None
    kept.views = OptimizerViews(optimizer, {param: {"exp_avg": flat[:3]}}, {}, on_step=lambda: kept.outdated("a step"))
    kept.drop("the next fit took it over")
    kept.drop("again")
    assert len(optimizer.state) == 0 and kept.checkpoint is None and kept.missing == "again"


def test_tensors_stagesafe_itself_replaced_keep_the_state_valid():
    tensors = {"a": torch.zeros(3)}
    kept = _kept(tensors, {})
    meta = {"a": torch.empty(3, device="meta")}
    kept.moved(fingerprint(tensors), meta)
    assert kept.holds(meta)
    other = {"a": torch.ones(3)}
    kept.moved(fingerprint(other), tensors)  # a move from tensors it was not kept with changes nothing
    assert kept.holds(meta)


def test_a_tensor_moved_into_pages_of_its_own_keeps_what_was_known_of_the_old_one():
    module = nn.Linear(3, 2)
    history = new_history(module)
    old = state_tensors(module)
    writer = _Writer()
    history.written(HandoffTarget(uri="/h"), old, writer)
    history.kept = _kept(old, {})
    new_weight = old["weight"].clone()
    history.moved_tensor("weight", old["weight"], new_weight)
    now = {**old, "weight": new_weight}
    assert history.holds(HandoffTarget(uri="/h"), now) and history.kept.holds(now)
    history.moved_tensor("bias", torch.zeros(2), torch.ones(2))  # not the tensor known: nothing changes
    assert history.holds(HandoffTarget(uri="/h"), now)
