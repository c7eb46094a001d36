"""Page-locking host tensors by whole pages (stagesafe/stages/page_lock.py): which pages form a run, that no
page is locked twice, and, on a GPU, that small tensors sharing pages copy from the device as pinned memory."""

from __future__ import annotations

import pytest
import torch

from stagesafe.stages import page_lock
from stagesafe.stages.page_lock import PAGE, page_runs


def _pages_of(tensor: torch.Tensor) -> set[int]:
    first, last = tensor.data_ptr() // PAGE, (tensor.data_ptr() + tensor.nbytes - 1) // PAGE
    return set(range(first, last + 1))


def test_tensors_sharing_pages_make_one_run_and_every_page_of_a_run_holds_their_bytes():
    flat = torch.zeros(12 * PAGE // 4)
    a, b = flat[: PAGE // 4 + 3], flat[PAGE // 4 + 10 : 3 * PAGE // 4]  # b starts on a's last page
    apart = flat[8 * PAGE // 4 : 9 * PAGE // 4 + 1]  # pages of its own, with a page between
    runs = page_runs([b, a, apart, a.detach()])  # a twice: once
    assert sorted(len(r.tensors) for r in runs) == [1, 2]
    for run in runs:
        assert run.start % PAGE == 0 and run.end % PAGE == 0
        pages = set(range(run.start // PAGE, run.end // PAGE))
        assert pages == set().union(*(_pages_of(t) for t in run.tensors))  # no page without one of its bytes
    (shared,) = [r for r in runs if len(r.tensors) == 2]
    assert shared.holds(a.data_ptr()) and shared.holds(b.data_ptr()) and not shared.holds(apart.data_ptr())


def test_only_memory_a_copy_can_use_is_planned():
    strided = torch.zeros(8, 2)[:, 0]
    assert page_runs([strided, torch.empty(0), torch.zeros(3, device="meta")]) == []


def test_a_run_overlapping_one_locked_elsewhere_is_left_out_before_cuda_is_asked():
    tensor = torch.zeros(3 * PAGE // 4)
    (run,) = page_runs([tensor])
    page_lock._locked[run.start + PAGE] = run.start + 2 * PAGE  # as if another buffer had locked a page of it
    try:
        assert page_lock.lock(run) == page_lock.LOCKED_ELSEWHERE
    finally:
        del page_lock._locked[run.start + PAGE]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_small_tensors_sharing_pages_are_locked_once_copied_into_and_unlocked():
    host = [torch.zeros(n) for n in (1000, 5000, 3, 4 << 20)]  # small ones from the C heap, one of 16 MB
    runs = page_runs(host)
    assert all(page_lock.lock(run) is None for run in runs)
    try:
        assert all(t.is_pinned() for t in host)  # CUDA sees each as page-locked memory
        stream = torch.cuda.Stream()
        sources = [torch.randn(t.shape, device="cuda") for t in host]
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
            for dest, src in zip(host, sources):
                dest.copy_(src, non_blocking=True)
        stream.synchronize()
        assert all(torch.equal(dest, src.cpu()) for dest, src in zip(host, sources))
        assert all(page_lock.lock(run) == page_lock.LOCKED_ELSEWHERE for run in runs)  # never twice
    finally:
        for run in runs:
            page_lock.unlock(run)
    assert not any(t.is_pinned() for t in host) and not page_lock._locked
