"""Host memory prepared for a stage's end: which tensors may be page-locked, and fresh buffers on the CPU."""

from __future__ import annotations

import torch

from stagesafe.stages.host import _MIN_LOCK_BYTES, HostBuffers, _lockable


def test_only_large_tensors_that_own_their_whole_allocation_are_locked_once_each():
    big = torch.empty(_MIN_LOCK_BYTES // 4, dtype=torch.float32)
    small = torch.empty(1000)
    flat = torch.empty(2 * _MIN_LOCK_BYTES // 4)
    half = flat[: _MIN_LOCK_BYTES // 4]  # a view: locking it would lock part of someone else's memory
    strided = torch.empty(_MIN_LOCK_BYTES // 4 * 2).reshape(-1, 2)[:, 0]
    chosen = _lockable([big, small, half, strided, big.detach()])
    assert [t.data_ptr() for t in chosen] == [big.data_ptr()]


def test_fresh_buffers_are_allocated_and_touched_in_the_background_on_a_cpu_run():
    existing = {"w": torch.ones(4, 3)}
    buffers = HostBuffers(existing, {"w": (torch.Size([4, 3]), torch.float32)}, lock_on=None).ready()
    fresh = buffers.fresh["w"]
    assert fresh.shape == (4, 3) and fresh.dtype == torch.float32
    assert fresh.data_ptr() != existing["w"].data_ptr()
    assert torch.count_nonzero(fresh) == 0  # touched: every page written once
    buffers.unlock()  # nothing was locked on the CPU: a no-op
    assert buffers.existing["w"] is existing["w"]
