"""Host memory the ranks of one host share (stagesafe/stages/shared_region.py), opened here by one process twice
as two ranks would: what one writes to the shared bytes the other reads, through its copy-on-write view too, even
where it read that page first; a write to a rank's own view stays its own; the header's marks; and the memory is
unmapped, with no descriptor left, once the last view goes."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from stagesafe.stages.shared_region import FAILED, WRITTEN, SharedRegion

NAME = "memfd:stagesafe-shared"


def _mapped() -> int:
    with open("/proc/self/maps", encoding="ascii") as f:
        return sum(NAME in line for line in f)


def _two() -> tuple[SharedRegion, SharedRegion]:
    first = SharedRegion.create(1 << 16, 2)
    second = SharedRegion.open(os.getpid(), first.fd, 1 << 16, 2)
    first.close_fd()
    return first, second


def test_what_one_rank_writes_the_other_reads_and_its_own_writes_stay_its_own():
    first, second = _two()
    theirs = second.private()
    assert theirs[:4].tolist() == [0, 0, 0, 0]  # the page read before it is written
    first.shared()[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert theirs[:4].tolist() == [1, 2, 3, 4]
    assert first.private()[:4].tolist() == [1, 2, 3, 4]
    theirs[0] = 9  # copy on write: this rank's alone
    assert theirs[:4].tolist() == [9, 2, 3, 4]
    assert first.private()[:4].tolist() == [1, 2, 3, 4] and second.shared()[:4].tolist() == [1, 2, 3, 4]


def test_every_rank_waits_for_every_ranks_mark_and_not_for_a_rank_that_failed():
    first, second = _two()
    assert not second.wait(0.01)
    first.mark(0, WRITTEN)
    assert not second.wait(0.01)
    second.mark(1, WRITTEN)
    assert first.wait(0.01) and second.wait(0.01)
    other, another = _two()
    other.mark(1, FAILED)
    assert not another.wait(60.0)  # at once: a failed rank is not waited for
    assert another.states() == [0, FAILED]


def test_the_memory_goes_once_its_last_view_goes_and_no_descriptor_is_left():
    gc.collect()
    mapped, fds = _mapped(), set(os.listdir("/proc/self/fd"))
    first, second = _two()
    view = second.private()[:8]
    assert _mapped() == mapped + 4  # two mappings each
    del first, second
    gc.collect()
    assert _mapped() == mapped + 1  # the view keeps its own mapping
    del view
    gc.collect()
    assert _mapped() == mapped and set(os.listdir("/proc/self/fd")) <= fds


def test_a_descriptor_that_is_not_the_region_is_refused():
    region = SharedRegion.create(4096, 2)
    with pytest.raises(OSError, match="not a shared region"):
        SharedRegion.open(os.getpid(), region.fd, 8192, 2)
    region.close_fd()
    with pytest.raises(ValueError, match="closed"):
        region.fd
