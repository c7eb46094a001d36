"""Reads into device memory through a bounded host buffer (stagesafe/zero/staged_reads.py), with a source that
copies from plain tensors: what ``direct`` refuses (device memory; here any tensor the test names) goes through
the staging buffer in batches no larger than half of it, and every element lands where it belongs, bit for bit."""

from __future__ import annotations

import pytest
import torch

from stagesafe.zero.staged_reads import read_staged


class _Source:
    """A checkpoint source over full values: ``read_all`` copies each asked run into its host ``out``, and
    records the bytes each call wrote and where they lay."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.values = values
        self.calls: list[list[tuple[str, int, int, int]]] = []  # per call: (name, first, count, data_ptr)

    def read_all(self, reads) -> None:
        call = []
        for name, key, first, out in reads:
            assert key is None and out.device.type == "cpu" and out.is_contiguous()
            out.copy_(self.values[name].reshape(-1).narrow(0, first, out.numel()))
            call.append((name, first, out.numel(), out.data_ptr()))
        self.calls.append(call)


def _values() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"big": torch.randn(5000), "odd": torch.randn(37).bfloat16(), "small": torch.randn(3, 4)}


def test_staged_targets_are_read_in_batches_that_fit_half_the_buffer_bit_for_bit():
    values = _values()
    source = _Source(values)
    targets = {name: torch.zeros(value.numel(), dtype=value.dtype) for name, value in values.items()}
    reads = [("big", None, 100, targets["big"][100:]), ("odd", None, 0, targets["odd"]),
             ("small", None, 2, targets["small"][2:]), ("big", None, 0, targets["big"][:100])]
    took = read_staged(source.read_all, reads, staging_bytes=4096, direct=lambda out: False)
    for name, value in values.items():
        expected = value.reshape(-1).clone()
        if name == "small":
            expected[:2] = 0  # not asked for: left as it was
        assert torch.equal(targets[name].view(torch.uint8), expected.view(torch.uint8))
    assert took == 4096  # two halves of 2048 bytes: nothing more was ever in host memory
    assert len(source.calls) > 4900 * 4 // 2048  # the big run was split
    for call in source.calls:
        assert sum(-(-count * values[name].element_size() // 64) * 64 for name, _, count, _ in call) <= 2048
    target_ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in targets.values()]
    staged_at = [ptr for call in source.calls for *_, ptr in call]
    assert not any(low <= ptr < high for ptr in staged_at for low, high in target_ranges)  # never the targets


def test_host_targets_are_read_straight_into_and_nothing_is_staged():
    values = _values()
    source = _Source(values)
    target = torch.empty(5000)
    assert read_staged(source.read_all, [("big", None, 0, target)], staging_bytes=4096) == 0
    assert torch.equal(target, values["big"])
    assert source.calls == [[("big", 0, 5000, target.data_ptr())]]


def test_only_what_direct_refuses_is_staged():
    values = _values()
    source = _Source(values)
    straight, staged = torch.empty(5000), torch.empty(37, dtype=torch.bfloat16)
    took = read_staged(source.read_all, [("big", None, 0, straight), ("odd", None, 0, staged)],
                       staging_bytes=1024, direct=lambda out: out is straight)
    assert took == 512  # one batch: one half made
    assert torch.equal(straight, values["big"]) and torch.equal(staged, values["odd"])
    assert source.calls[0] == [("big", 0, 5000, straight.data_ptr())]
    assert [(n, f, c) for n, f, c, _ in source.calls[1]] == [("odd", 0, 37)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_targets_are_staged_through_page_locked_halves_and_arrive_bit_for_bit():
    values = {"big": torch.randn(3_000_000), "odd": torch.randn(37).bfloat16()}
    source = _Source(values)
    targets = {name: torch.full((v.numel(),), 7, dtype=v.dtype, device="cuda") for name, v in values.items()}
    reads = [("big", None, 0, targets["big"]), ("odd", None, 0, targets["odd"])]
    took = read_staged(source.read_all, reads, staging_bytes=2**20)  # 12 MB through two halves of 512 KiB
    assert took == 2**20 and len(source.calls) > 20
    for name, value in values.items():
        assert torch.equal(targets[name].cpu().view(torch.uint8), value.view(torch.uint8))
