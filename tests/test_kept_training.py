"""What a boundary keeps of the engine, without an engine: its validity, host copies, and the folder it becomes.

The end-to-end proof (a real fit, its checkpoint resumed bitwise by stagesafe and by stock Lightning) is in
tests/test_engine_state.py; these check the pieces on plain tensors, in the fast tier.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from stagesafe.stages.history import KeptTraining, fingerprint
from stagesafe.stages.host import HostPool
from stagesafe.zero.checkpoint_writer import WEIGHTS_ONLY_MARKER, is_weights_only, write_engine_checkpoint
from stagesafe.zero.engine import _to_host


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


def test_tensors_stagesafe_itself_replaced_keep_the_state_valid():
    tensors = {"a": torch.zeros(3)}
    kept = _kept(tensors, {})
    meta = {"a": torch.empty(3, device="meta")}
    kept.moved(fingerprint(tensors), meta)
    assert kept.holds(meta)
    other = {"a": torch.ones(3)}
    kept.moved(fingerprint(other), tensors)  # a move from tensors it was not kept with changes nothing
    assert kept.holds(meta)


def test_host_copies_are_private_and_keep_the_containers():
    weight = torch.arange(6, dtype=torch.float32)
    state = {"optimizer_state_dict": OrderedDict(state={0: {"exp_avg": weight}}, groups=[weight, (weight, 3)]),
             "loss_scaler": object(), "step": 7}
    copies: list = []
    host = _to_host(state, copies)
    assert type(host["optimizer_state_dict"]) is OrderedDict
    copied = host["optimizer_state_dict"]["state"][0]["exp_avg"]
    weight.add_(1)  # the engine's tensor changes: the kept copy does not
    assert torch.equal(copied, torch.arange(6, dtype=torch.float32))
    assert isinstance(host["optimizer_state_dict"]["groups"][1], tuple)
    assert host["loss_scaler"] is state["loss_scaler"] and host["step"] == 7
    assert len(copies) == 3


def test_the_kept_files_are_written_as_deepspeed_names_them_with_the_client_state(tmp_path):
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    open(os.path.join(path, WEIGHTS_ONLY_MARKER), "w").close()  # an earlier weights-only save into the folder
    files = {
        "zero_pp_rank_0_mp_rank_00_model_states.pt": {"module": {}, "global_steps": 4},
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": {"optimizer_state_dict": {"x": torch.ones(2)}},
    }
    client = {"epoch": 1, "lr_schedulers": [{"last_epoch": 4}]}
    write_engine_checkpoint(path, files, client_state=client, latest=True)
    folder = os.path.join(path, "checkpoint")
    assert sorted(os.listdir(folder)) == sorted(files)  # no temporary file left
    model = torch.load(os.path.join(folder, "zero_pp_rank_0_mp_rank_00_model_states.pt"), weights_only=False)
    assert model == {"module": {}, "global_steps": 4, **client}
    optim = torch.load(os.path.join(folder, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"), weights_only=False)
    assert set(optim) == {"optimizer_state_dict"}  # the client state goes to model states only, as DeepSpeed does
    assert open(os.path.join(path, "latest")).read() == "checkpoint"
    assert not is_weights_only(path)


def test_ranks_without_latest_write_only_their_files(tmp_path):
    path = str(tmp_path / "ckpt")
    write_engine_checkpoint(path, {"zero_pp_rank_1_mp_rank_00_model_states.pt": {}}, client_state={}, latest=False)
    assert os.listdir(path) == ["checkpoint"]


def test_host_pool_hands_out_its_tensors_by_shape_and_dtype_once_each():
    specs = [(torch.Size([4, 2]), torch.float32), (torch.Size([4, 2]), torch.float32), (torch.Size([3]), torch.bfloat16)]
    pool = HostPool(specs, lock_on=None)
    first, second = pool.take(torch.Size([4, 2]), torch.float32), pool.take(torch.Size([4, 2]), torch.float32)
    assert first is not None and second is not None and first.data_ptr() != second.data_ptr()
    assert first.shape == (4, 2) and first.dtype == torch.float32 and first.device.type == "cpu"
    assert pool.take(torch.Size([4, 2]), torch.float32) is None  # all taken: the caller allocates
    assert pool.take(torch.Size([3]), torch.float32) is None  # no such dtype
    assert pool.take(torch.Size([3]), torch.bfloat16).dtype == torch.bfloat16
    owner = _kept({}, {})
    pool.close(owner)
    assert pool.take(torch.Size([3]), torch.bfloat16) is None  # a closed pool hands out nothing


def test_a_host_pool_adds_only_what_it_does_not_hold_yet():
    a, b = (torch.Size([4]), torch.float32), (torch.Size([2, 2]), torch.bfloat16)
    pool = HostPool([a, a], lock_on=None)
    pool.add([a, a, b])  # foreseen at the engine's start, then sized after the first step: only b is new
    taken = [pool.take(*a), pool.take(*a), pool.take(*b)]
    assert all(t is not None for t in taken) and len({t.data_ptr() for t in taken}) == 3
    assert pool.take(*a) is None and pool.take(*b) is None  # no duplicate was made
    pool.close(None)
