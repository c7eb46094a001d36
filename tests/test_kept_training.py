"""HostPool's tests, left here until they join tests/test_host.py (the module they test). The tests of
KeptTraining are in tests/test_history.py, of ``_to_host`` in tests/test_engine.py, of ``write_engine_checkpoint``
in tests/test_checkpoint_writer.py."""

from __future__ import annotations

import torch

from stagesafe.stages.history import KeptTraining, fingerprint
from stagesafe.stages.host import HostPool


def _kept(tensors: dict[str, torch.Tensor], masters: dict[str, torch.Tensor]) -> KeptTraining:
    return KeptTraining(fingerprint(tensors), masters=masters)


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
