"""Page-locking host tensors in place (stagesafe/stages/page_lock.py): only storages in pages of their own
(stagesafe's own mappings) are ever locked, each once per process; on a GPU, locked tensors copy as pinned memory
and every other host tensor, its neighbours on the C heap included, still copies (CUDA refuses a copy whose bytes
are partly locked)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from _launch import run_script

from stagesafe.stages import page_lock
from stagesafe.stages.page_lock import PAGE, empty, lockable, page_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_empty_gives_a_tensor_in_pages_of_its_own_whatever_its_size():
    tensor = empty((3, 5), torch.float32)
    storage = tensor.untyped_storage()
    assert tensor.shape == (3, 5) and tensor.dtype == torch.float32 and storage.nbytes() == 60
    assert tensor.data_ptr() % PAGE == 0 and lockable(tensor)
    (run,) = page_runs([tensor, tensor[1:], tensor.detach()])  # views of one storage: one run
    assert (run.start, run.end, len(run.tensors)) == (tensor.data_ptr(), tensor.data_ptr() + PAGE, 3)
    tensor.fill_(2.0)
    assert tensor.sum().item() == 30.0
    assert empty((0, 4), torch.bfloat16).shape == (0, 4)


def test_memory_from_empty_is_forgotten_once_its_tensors_are_gone():
    tensor = empty((1000,), torch.int64)
    start = tensor.data_ptr()
    view = tensor[10:]
    del tensor
    gc.collect()
    assert (start, start + 8000 + (-8000 % PAGE)) in page_lock.own_mappings()  # a view keeps the mapping
    del view
    gc.collect()
    assert start not in dict(page_lock.own_mappings())


def test_small_tensors_of_the_c_heap_are_never_locked_for_their_pages_hold_other_allocations():
    neighbours = [torch.zeros(n) for n in (1000, 5000, 3, 4 << 20)]  # 16 MB too: it may come from the heap
    assert not any(lockable(t) for t in neighbours) and page_runs(neighbours) == []


def _carved(mode: str) -> dict:
    """tests/scripts/heap_carved.py in a fresh process (a heap no other test has shaped), its JSON line."""
    done = run_script(os.path.join(ROOT, "tests", "scripts", "heap_carved.py"), [mode], env={"DS_ACCELERATOR": None})
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_large_tensor_the_heap_carved_out_of_freed_memory_is_never_locked_for_its_pages_hold_others_too():
    """glibc maps a block of 32 MiB or more on its own only when no free block of the heap can hold it. In a
    long process one often can: such a tensor then shares its first and last pages with its neighbours."""
    seen = _carved("lockable")
    assert seen["in_heap"] and seen["mid_page"]  # two 40 MiB tensors, one after the other in the C heap
    assert seen["lockable"] == [False, False] and seen["runs"] == 0
    assert not lockable(torch.empty(40 << 18))  # mapped on its own or not, the C allocator's is never locked


def test_nothing_a_copy_cannot_use_is_planned():
    assert page_runs([torch.empty(0), torch.zeros(3, device="meta")]) == []


def test_a_storage_locked_elsewhere_is_left_out_before_cuda_is_asked():
    (run,) = page_runs([empty((3 * PAGE // 4,), torch.float32)])
    page_lock._locked[run.start] = (run.end, 0)  # as if another buffer had locked it
    try:
        assert page_lock.lock(run) == page_lock.LOCKED_ELSEWHERE
    finally:
        del page_lock._locked[run.start]


@pytest.mark.gpu
@gpu
def test_locked_tensors_copy_as_pinned_memory_and_their_heap_neighbours_still_copy():
    heap = [torch.randn(n) for n in (1000, 5000, 3, 257, 4 << 20)]  # interleaved with ours on the C heap
    ours = [empty((n,), torch.float32) for n in (1000, 3, 4 << 20)]
    heap += [torch.randn(n) for n in (999, 17)]
    runs = page_runs([*heap, *ours])
    assert len(runs) == len(ours)
    assert all(page_lock.lock(run) is None for run in runs)
    try:
        assert all(t.is_pinned() for t in ours) and not any(t.is_pinned() for t in heap)
        for tensor in heap:  # CUDA fails a copy of bytes partly locked: none of these may be
            assert torch.equal(tensor.to("cuda").cpu(), tensor)
        stream = torch.cuda.Stream()
        sources = [torch.randn(t.shape, device="cuda") for t in ours]
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
            for dest, src in zip(ours, sources):
                dest.copy_(src, non_blocking=True)
        stream.synchronize()
        assert all(torch.equal(dest, src.cpu()) for dest, src in zip(ours, sources))
        assert all(page_lock.lock(run) == page_lock.LOCKED_ELSEWHERE for run in runs)  # never twice
    finally:
        for run in runs:
            page_lock.unlock(run)
    assert not any(t.is_pinned() for t in ours) and page_lock.locked_ranges() == []


@pytest.mark.gpu
@gpu
def test_large_heap_neighbours_both_copy_while_a_stages_host_memory_is_ready():
    """What failed on an H200 in a process's third fit: the module's 50 MB tensor, carved from the heap, was
    locked in place with the page its neighbour starts in, and the neighbour's copy to the GPU was refused."""
    seen = _carved("copy")
    assert seen["in_heap"] and seen["mid_page"]
    assert seen["locked"] == 0 and seen["copies"] == [True, True, True]


@pytest.mark.gpu
@gpu
def test_pages_whose_owner_never_unlocked_them_are_unlocked_before_they_are_freed():
    from stagesafe.stages.host import HostBuffers

    ours = empty((1 << 20,), torch.float32)
    (run,) = page_runs([ours])
    assert page_lock.lock(run) is None
    start = run.start
    del ours, run  # no unlock: the mapping's release unlocks it before the pages go
    gc.collect()
    assert start not in dict(page_lock.locked_ranges()) and start not in dict(page_lock.own_mappings())
    large = empty((8 << 20,), torch.float32).zero_()
    buffers = HostBuffers({"large": large}, {"fresh": (torch.Size([1000]), torch.float32)},
                          lock_on=torch.device("cuda", torch.cuda.current_device())).ready()
    assert large.is_pinned() and buffers.fresh["fresh"].is_pinned()
    del buffers  # dropped without unlock(): its runs are unlocked as it goes
    gc.collect()
    assert not large.is_pinned() and page_lock.locked_ranges() == []
    for _ in range(3):  # memory mapped again where those pages were copies as pageable memory
        fresh = [torch.randn(n) for n in (8 << 20, 1 << 20, 100)]
        assert all(torch.equal(t.to("cuda").cpu(), t) for t in fresh)


def test_memory_from_empty_stays_readable_by_the_users_exit_hooks(tmp_path):
    script = tmp_path / "ends.py"
    script.write_text(
        "import atexit, sys\n"
        "kept = []\n"
        "atexit.register(lambda: print('read at exit:', kept[0].sum().item(), flush=True))  # before any import\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import torch\n"
        "from stagesafe.stages import page_lock\n"
        "kept.append(page_lock.empty((1000,), torch.float32).fill_(1.0))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "read at exit: 1000.0\n"), done.stderr[-2000:]
