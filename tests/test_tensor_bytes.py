"""handoff/tensor_bytes.py: many small tensors' bytes gathered into one chunk. Which tensors qualify, and that
the chunk is their bytes in the format's order, each copied as it was added."""

from __future__ import annotations

import torch

from stagesafe.handoff.tensor_bytes import SMALL, SmallRun


def test_small_contiguous_host_tensors_qualify_and_others_take_the_general_path():
    assert SmallRun.takes(torch.ones(4))
    assert SmallRun.takes(torch.nn.Parameter(torch.ones(4)))
    assert not SmallRun.takes(torch.ones(4, 4).t())  # not contiguous
    assert not SmallRun.takes(torch.ones(SMALL // 4 + 1))  # too large for a run
    assert not SmallRun.takes(torch.ones(2, dtype=torch.complex64).conj())  # a lazy conjugate
    assert not SmallRun.takes(torch.ones(2)._neg_view())  # a lazy negative


def test_a_run_is_the_tensors_bytes_in_order_copied_when_added():
    run = SmallRun()
    a, b = torch.arange(3, dtype=torch.int32), torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert run.add(a) is False and run.add(torch.empty(0)) is False and run.add(b) is False
    a.zero_()  # changed after it was added: the run holds the bytes it had
    assert run.nbytes == 12 + 4
    data = run.take()
    assert data == torch.arange(3, dtype=torch.int32).numpy().tobytes() + b.view(torch.int16).numpy().tobytes()
    assert run.take() == b"" and run.nbytes == 0


def test_a_run_says_when_it_is_full_enough_to_take():
    run = SmallRun()
    chunk = torch.zeros(SMALL // 4 - 1)  # just under the size of a small tensor
    full = [run.add(chunk) for _ in range(17)]
    assert full[-1] is True and full[0] is False
