"""stagesafe.zero.engine.optimizer_views on plain data: kept checkpoint files as DeepSpeed's optimizer state dicts
hold them (the torch optimizer's state by flat partition number), parameters with places in the flats. The places
read from a live engine, and the whole path after a fit: tests/test_trainer_optimizer_state.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stagesafe import InvalidArgumentError
from stagesafe.zero.engine.optimizer_views import Place, StatePlaces, attach_views

FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _setup(key: str = "optimizer_state_dict", dtype: torch.dtype = torch.float32):
    """Two parameters (2x3 and 4) back to back in one flat partition (numbered 0) with 2 elements of padding, and a
    third whose partition (numbered 1) has no state yet; AdamW over them."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(2, 3).to(dtype)), nn.Parameter(torch.randn(4).to(dtype)),
              nn.Parameter(torch.randn(5).to(dtype))]
    flat = {"exp_avg": torch.randn(12), "exp_avg_sq": torch.rand(12), "step": torch.tensor(7.0)}
    files = {FILE: {"optimizer_state_dict": {key: {"state": {0: flat}, "param_groups": []}}}, "model.pt": {}}
    places = StatePlaces(FILE, (Place(params[0], "a", 0, 0, torch.Size([2, 3])),
                                Place(params[1], "b", 0, 6, torch.Size([4])),
                                Place(params[2], "c", 1, 0, torch.Size([5]))))
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)
    return params, flat, files, places, optimizer


@pytest.mark.parametrize("key", ["optimizer_state_dict", "base_optimizer_state"])  # ZeRO-3; ZeRO 1/2, BF16_Optimizer
def test_each_parameters_moments_are_views_of_its_shape_into_the_flat_and_its_step_a_copy(key):
    params, flat, files, places, optimizer = _setup(key)
    views = attach_views(optimizer, files, places, on_step=lambda: None)
    assert views is not None and optimizer.state is views.state
    a, b = optimizer.state[params[0]], optimizer.state[params[1]]
    assert a["exp_avg"].shape == (2, 3) and b["exp_avg_sq"].shape == (4,)
    assert a["exp_avg"].data_ptr() == flat["exp_avg"].data_ptr()
    assert b["exp_avg"].data_ptr() == flat["exp_avg"].data_ptr() + 6 * 4
    assert torch.equal(b["exp_avg_sq"], flat["exp_avg_sq"][6:10])
    assert a["step"] is not b["step"] and a["step"] is not flat["step"] and a["step"].item() == 7.0
    assert params[2] not in optimizer.state  # no state yet for its partition: none, as stock before a step


def test_files_not_in_the_laid_out_form_give_no_views():
    params, flat, files, places, optimizer = _setup()
    elastic = {FILE: {"optimizer_state_dict": {"base_optimizer_state": [flat]}}}  # ZeRO 1/2's elastic form
    assert attach_views(optimizer, elastic, places, on_step=lambda: None) is None
    assert attach_views(optimizer, {}, places, on_step=lambda: None) is None
    short = {FILE: {"optimizer_state_dict": {"optimizer_state_dict": {"state": {0: {"exp_avg": torch.zeros(8)}}}}}}
    assert attach_views(optimizer, short, places, on_step=lambda: None) is None  # b would run past its end
    assert len(optimizer.state) == 0


def test_a_step_runs_in_place_in_the_kept_flat_and_says_so_once():
    params, flat, files, places, optimizer = _setup()
    steps = []
    attach_views(optimizer, files, places, on_step=lambda: steps.append(1))
    before = flat["exp_avg"].clone()
    for param in params[:2]:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert steps == [1]
    assert torch.allclose(flat["exp_avg"][:10], before[:10] * 0.9 + 0.1)  # AdamW's beta1: the flat itself moved
    assert torch.equal(flat["exp_avg"][10:], before[10:])  # the padding is nobody's
    assert optimizer.state[params[0]]["step"].item() == 8.0 and flat["step"].item() == 7.0


def test_drop_empties_the_optimizers_state_and_stops_watching_its_steps():
    params, flat, files, places, optimizer = _setup()
    steps = []
    views = attach_views(optimizer, files, places, on_step=lambda: steps.append(1))
    views.drop()
    assert len(optimizer.state) == 0
    params[0].grad = torch.ones_like(params[0])
    before = flat["exp_avg"].clone()
    optimizer.step()  # a fresh state of its own, as torch makes it
    assert steps == [] and torch.equal(flat["exp_avg"], before)
    views.drop()  # twice is fine


def test_a_state_the_user_loaded_instead_is_left_alone():
    params, flat, files, places, optimizer = _setup()
    steps = []
    views = attach_views(optimizer, files, places, on_step=lambda: steps.append(1))
    optimizer.load_state_dict(optimizer.state_dict())  # torch replaces the state with copies of its own
    params[0].grad = torch.ones_like(params[0])
    optimizer.step()
    assert steps == []
    views.drop()
    assert len(optimizer.state) == 2  # the user's state, not the views


def test_a_step_on_16_bit_parameters_beside_fp32_state_is_refused_before_anything_changes():
    params, flat, files, places, optimizer = _setup(dtype=torch.bfloat16)
    steps = []
    attach_views(optimizer, files, places, on_step=lambda: steps.append(1))
    params[1].grad = torch.ones_like(params[1])
    before, moments = params[1].detach().clone(), flat["exp_avg"].clone()
    with pytest.raises(InvalidArgumentError, match=r"'b' is held in torch.bfloat16 and its optimizer state.*"
                                                   r"torch.float32.*nothing was changed"):
        optimizer.step()
    assert torch.equal(params[1].detach(), before) and torch.equal(flat["exp_avg"], moments) and steps == []
    params[1].grad = None
    optimizer.step()  # no parameter with a gradient: nothing to refuse
    assert steps == [1]


def _flat_state(files: dict) -> dict:
    """The kept file's state of flat partition 0, where a copy off the device puts its host tensors."""
    return files[FILE]["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]


def _on_device(files: dict, flat: dict) -> dict:
    """Put meta tensors where ``flat``'s per-element tensors are (the engine's device tensors, not yet copied);
    returns the host ones a copy would put back."""
    held = _flat_state(files)
    host = {k: held[k] for k in ("exp_avg", "exp_avg_sq")}
    held.update({k: torch.empty(v.shape, device="meta") for k, v in host.items()})
    return host


def _copy_later(files: dict, host: dict, copied, *, after: float = 0.2):
    """The writer's device thread: after ``after`` seconds, the host tensors in place, then ``copied`` set."""
    import threading
    import time

    def copy() -> None:
        time.sleep(after)
        _flat_state(files).update(host)
        copied.set()

    thread = threading.Thread(target=copy)
    thread.start()
    return thread


def test_a_state_still_on_the_device_is_seen_empty_without_waiting_until_the_call_returned():
    import threading

    params, flat, files, places, optimizer = _setup()
    host, copied = _on_device(files, flat), threading.Event()
    views = attach_views(optimizer, files, places, on_step=lambda: None, copied=copied, timeout=60)
    assert views is not None and optimizer.state is views.state
    assert len(optimizer.state) == 0 and list(optimizer.state.items()) == []  # Lightning's teardown: no wait
    entry = optimizer.state[params[0]]  # made by a read there, as a defaultdict makes it
    _flat_state(files).update(host)
    copied.set()
    assert optimizer.state[params[0]] is entry and entry["exp_avg"].data_ptr() == host["exp_avg"].data_ptr()
    assert optimizer.state[params[1]]["exp_avg_sq"].data_ptr() == host["exp_avg_sq"].data_ptr() + 6 * 4


@pytest.mark.parametrize("first_use", ["read", "step", "state_dict"])
def test_once_the_call_returned_the_first_use_waits_for_the_copy_then_finds_the_views(first_use):
    import threading

    params, flat, files, places, optimizer = _setup()
    host, copied = _on_device(files, flat), threading.Event()
    steps = []
    views = attach_views(optimizer, files, places, on_step=lambda: steps.append(1), copied=copied, timeout=60)
    views.call_returned()
    thread = _copy_later(files, host, copied)
    before = host["exp_avg"].clone()
    if first_use == "read":
        assert optimizer.state[params[0]]["exp_avg"].data_ptr() == host["exp_avg"].data_ptr()
    elif first_use == "step":
        params[0].grad = torch.ones_like(params[0])
        optimizer.step()  # on the kept moments, not on a fresh state made before they arrived
        assert steps == [1] and torch.allclose(host["exp_avg"][:6], before[:6] * 0.9 + 0.1)
        assert optimizer.state[params[0]]["step"].item() == 8.0
    else:
        saved = optimizer.state_dict()["state"]
        assert sorted(saved) == [0, 1] and torch.equal(saved[1]["exp_avg"], before[6:10])
    assert copied.is_set()
    thread.join()


def test_a_state_dropped_before_its_copy_stays_empty():
    import threading

    params, flat, files, places, optimizer = _setup()
    host, copied = _on_device(files, flat), threading.Event()
    views = attach_views(optimizer, files, places, on_step=lambda: None, copied=copied, timeout=60)
    views.call_returned()
    views.drop()  # the copy failed: the kept state went before any view was made
    _flat_state(files).update(host)
    copied.set()
    assert len(optimizer.state) == 0 and params[0] not in optimizer.state


def test_a_copy_that_never_ends_leaves_the_state_empty_after_the_timeout(caplog):
    import threading

    params, flat, files, places, optimizer = _setup()
    _on_device(files, flat)
    views = attach_views(optimizer, files, places, on_step=lambda: None, copied=threading.Event(), timeout=0.1)
    views.call_returned()
    with caplog.at_level("WARNING"):
        assert len(optimizer.state) == 0
    assert "not copied off the device within 0.1 s" in caplog.text
    assert len(optimizer.state) == 0  # said once; not waited for again


def test_a_copy_of_the_pending_state_is_a_plain_filled_one():
    import copy
    import pickle
    import threading
    from collections import defaultdict

    params, flat, files, places, optimizer = _setup()
    copied = threading.Event()
    copied.set()  # the copy off the device is over
    attach_views(optimizer, files, places, on_step=lambda: None, copied=copied)
    for other in (copy.deepcopy(optimizer.state), copy.copy(optimizer.state), optimizer.state.copy(),
                  pickle.loads(pickle.dumps(dict(optimizer.state))), defaultdict(dict, optimizer.state)):
        assert len(other) == 2 and torch.equal(other[next(iter(other))]["exp_avg"], flat["exp_avg"][:6].view(2, 3))
        other.clear()  # not the optimizer's
    assert len(optimizer.state) == 2
