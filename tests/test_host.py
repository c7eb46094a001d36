"""Host memory prepared for a stage's end: which tensors may be page-locked, and fresh buffers on the CPU."""

from __future__ import annotations

import torch

import gc
import weakref

from stagesafe.stages import page_lock
from stagesafe.stages.host import HostBuffers, HostPool


def test_fresh_buffers_are_allocated_and_touched_in_the_background_on_a_cpu_run():
    existing = {"w": torch.ones(4, 3)}
    buffers = HostBuffers(existing, {"w": (torch.Size([4, 3]), torch.float32)}, lock_on=None).ready()
    fresh = buffers.fresh["w"]
    assert fresh.shape == (4, 3) and fresh.dtype == torch.float32
    assert fresh.data_ptr() != existing["w"].data_ptr()
    assert torch.count_nonzero(fresh) == 0  # touched: every page written once
    buffers.unlock()  # nothing was locked on the CPU: a no-op
    assert buffers.existing["w"] is existing["w"]


def test_host_pool_hands_out_its_tensors_by_shape_and_dtype_once_each():
    specs = [(torch.Size([4, 2]), torch.float32), (torch.Size([4, 2]), torch.float32), (torch.Size([3]), torch.bfloat16)]
    pool = HostPool(specs, lock_on=None)
    first, second = pool.take(torch.Size([4, 2]), torch.float32), pool.take(torch.Size([4, 2]), torch.float32)
    assert first is not None and second is not None and first.data_ptr() != second.data_ptr()
    assert first.shape == (4, 2) and first.dtype == torch.float32 and first.device.type == "cpu"
    assert pool.take(torch.Size([4, 2]), torch.float32) is None  # all taken: the caller allocates
    assert pool.take(torch.Size([3]), torch.float32) is None  # no such dtype
    assert pool.take(torch.Size([3]), torch.bfloat16).dtype == torch.bfloat16
    pool.close()
    assert pool.take(torch.Size([3]), torch.bfloat16) is None  # a closed pool hands out nothing


def test_a_host_pool_adds_only_what_it_does_not_hold_yet():
    a, b = (torch.Size([4]), torch.float32), (torch.Size([2, 2]), torch.bfloat16)
    pool = HostPool([a, a], lock_on=None)
    pool.add([a, a, b])  # foreseen at the engine's start, then sized after the first step: only b is new
    taken = [pool.take(*a), pool.take(*a), pool.take(*b)]
    assert all(t is not None for t in taken) and len({t.data_ptr() for t in taken}) == 3
    assert pool.take(*a) is None and pool.take(*b) is None  # no duplicate was made
    pool.close()


def test_making_host_memory_ready_waits_while_it_is_held_and_ready_never_waits_for_a_hold():
    import threading

    go_on = threading.Event()
    buffers = HostBuffers({}, {"a": (torch.Size([1 << 20]), torch.float32)}, lock_on=None, go_on=go_on)
    assert not buffers.wait(0.3) and buffers.fresh == {}  # held before its first piece
    go_on.set()
    assert buffers.ready().fresh["a"].shape == (1 << 20,)
    pool = HostPool([(torch.Size([1 << 20]), torch.float32)], lock_on=None)
    pool.hold()
    assert pool.ready().take(torch.Size([1 << 20]), torch.float32) is not None  # ready() ends the hold: no deadlock
    pool.close()


def test_a_held_pool_waits_until_released_and_close_ends_a_hold_too():
    pieces = [(torch.Size([1 << 20]), torch.float32)]
    for end in ("release", "close"):
        pool = HostPool([], lock_on=None)
        pool.hold()
        pool.add(pieces)  # asked for while held, as after the first optimizer step
        assert not pool.wait(0.3) and pool.made_ready == 0  # nothing made ready while held
        pool.release() if end == "release" else pool.close()
        assert pool.wait(5)
        pool.close()


def test_a_pool_takes_over_ready_tensors_and_makes_only_what_they_do_not_cover():
    a, b = (torch.Size([4]), torch.float32), (torch.Size([2, 2]), torch.bfloat16)
    last = [torch.arange(4, dtype=torch.float32), torch.zeros(2, 2, dtype=torch.bfloat16)]  # the last fit's kept state
    pool = HostPool([], lock_on=None)
    pool.adopt(last)
    pool.add([a, a, b])  # only one more of a is new
    assert pool.nbytes == 2 * 16 + 8
    assert pool.wait(5) and pool.made_ready == 16  # one more of a: the rest is adopted
    taken = [pool.take(*a), pool.take(*a), pool.take(*b)]
    assert {t.data_ptr() for t in taken} >= {t.data_ptr() for t in last}  # the adopted memory is handed out again
    assert pool.take(*a) is None and pool.take(*b) is None
    pool.close()


def test_the_c_allocators_tensors_move_into_pages_of_their_own_one_at_a_time_and_tied_ones_once():
    weight, bias = torch.randn(300, 200), torch.randn(300)
    gone = weakref.ref(weight)
    swap = {"w": weight, "tied": weight, "b": bias}
    holder = dict(swap)  # where the caller holds them: the boundary's entry
    moved = []

    def replace(name, old, new):
        assert holder[name] is old
        holder[name] = new
        moved.append(name)

    expected = {n: t.clone() for n, t in swap.items()}
    del weight, bias
    buffers = HostBuffers({}, {}, swap=swap, replace=replace, lock_on=None).ready()
    del swap
    assert sorted(moved) == ["b", "tied", "w"] and buffers.swapped == {"w", "tied", "b"}
    assert holder["w"] is holder["tied"] is buffers.existing["w"]  # tied: one copy for both names
    for name, tensor in holder.items():
        assert torch.equal(tensor, expected[name])
        assert page_lock.lockable(tensor)  # pages of its own: a GPU run can lock it whole
    gc.collect()
    assert gone() is None  # the C allocator's tensor is let go: the module is never held twice


def test_a_stopped_swap_leaves_the_rest_where_it_is():
    go_on = __import__("threading").Event()  # held: nothing moves
    swap = {"a": torch.ones(1000), "b": torch.ones(10)}
    buffers = HostBuffers({}, {}, swap=dict(swap), lock_on=None, go_on=go_on)
    buffers._stop.set()
    go_on.set()
    buffers.stop()
    assert len(buffers.swapped) <= 1 and sorted(buffers.existing) == ["a", "b"]  # the rest as they were
    assert all(buffers.existing[n] is swap[n] for n in ("a", "b") if n not in buffers.swapped)
