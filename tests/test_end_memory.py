"""The host memory a stage's end copies into, chosen while the stage runs: on the CPU (nothing to page-lock), and
on a GPU, where what cannot be page-locked in place gets memory of its own."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _launch import run_script
from torch import nn

from stagesafe.stages.end_memory import EndMemory, end_specs
from stagesafe.stages.history import state_tensors


def _memory(**kwargs) -> EndMemory:
    options = {"device": torch.device("cpu"), "max_shard_size": "1GB", "writers": 1, "training": True,
               "keep_optimizer_state": True, "exclude_frozen": False, "stage": "fit", **kwargs}
    return EndMemory(**options)


def _module() -> nn.Module:
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2).to(torch.bfloat16))
    module[1].weight.requires_grad_(False)  # frozen: it comes back from the engine as it went in
    return module


def _original(module: nn.Module) -> dict:
    return {n: (t.dtype, t.device) for n, t in state_tensors(module).items()}


def test_a_fit_copies_fp32_masters_into_the_modules_own_tensors_and_16_bit_ones_into_new_fp32_ones():
    module = _module()
    tensors = state_tensors(module)
    memory = _memory()
    memory.prepare_weights(module, tensors, original=_original(module), built=set())
    weights = memory.weights_ready()
    assert sorted(weights.existing) == ["0.bias", "0.weight", "1.bias", "2.bias", "2.weight", "3.bias", "3.weight"]
    assert all(weights.existing[n].data_ptr() == tensors[n].data_ptr() for n in ("0.weight", "0.bias", "1.bias"))
    for name in ("3.weight", "3.bias"):  # the module holds bf16: its fp32 master lands in host memory of its own
        assert weights.existing[name].dtype == torch.float32 and weights.existing[name].shape == tensors[name].shape
    # this rank writes every shard: private copies of what the user could change, not of 16-bit masters
    assert sorted(weights.fresh) == ["0.bias", "0.weight", "1.bias", "2.bias", "2.weight"]
    assert all(weights.fresh[n].data_ptr() != tensors[n].data_ptr() for n in weights.fresh)
    assert memory.written_here == set(tensors)


def test_a_parameter_zero_init_built_gets_new_host_memory_of_its_full_shape():
    module = _module()
    tensors = state_tensors(module)
    module[0].weight.ds_shape = torch.Size([3, 4])
    module[0].weight.data = torch.empty(0)  # a ZeRO-3 placeholder: only the engine has its value
    tensors = state_tensors(module)
    memory = _memory()
    memory.prepare_weights(module, tensors, original=_original(module), built={"0.weight"})
    new = memory.weights_ready().existing["0.weight"]
    assert new.shape == (3, 4) and new.dtype == torch.float32 and new.data_ptr() != tensors["0.weight"].data_ptr()
    assert end_specs(module, tensors, original=_original(module), built={"0.weight"})[0]["0.weight"]["shape"] == [3, 4]


def test_nothing_is_prepared_where_nothing_trains_and_tied_names_are_planned_once():
    module = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    module[1].weight = module[0].weight
    for param in module.parameters():
        param.requires_grad_(False)
    memory = _memory()
    memory.prepare_weights(module, state_tensors(module), original=_original(module), built=set())
    assert memory.weights_ready() is None and memory.written_here is None
    specs, aliases = end_specs(module, state_tensors(module), original=_original(module), built=set())
    assert aliases == {"1.weight": "0.weight"}
    assert memory.plan_writes(specs, aliases) == {"0.weight", "0.bias", "1.bias"}  # a tied name is its first's
    assert memory.plan_writes({}, {}) is memory.written_here  # planned once: the stage's end reuses it


def test_a_fit_that_keeps_no_optimizer_state_says_why_without_asking_the_engine():
    memory = _memory(keep_optimizer_state=False)
    assert memory.keep_engine_state(engine=None) == (
        None, "StageSafeDeepSpeedStrategy(keep_optimizer_state=False) keeps none between Trainer calls"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_c_allocators_tensors_get_host_memory_of_their_own_stagesafes_are_locked_in_place():
    from stagesafe.stages.page_lock import empty

    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(4096, 2048, bias=False))  # 32 MiB: maybe mapped on its own
    ours = empty(module[1].weight.shape, torch.float32).copy_(module[1].weight.detach())
    module[1].weight = nn.Parameter(ours)  # as a stage's end leaves it: stagesafe's own pages
    tensors = state_tensors(module)
    memory = _memory(device=torch.device("cuda", torch.cuda.current_device()))
    memory.prepare_weights(module, tensors, original=_original(module), built=set())
    weights = memory.weights_ready()
    try:
        existing = weights.existing
        assert existing["1.weight"].data_ptr() == tensors["1.weight"].data_ptr()  # in place
        for name in ("0.weight", "0.bias"):  # the C allocator's: replaced by tensors of their own pages
            assert existing[name].data_ptr() != tensors[name].data_ptr() and existing[name].shape == tensors[name].shape
        assert all(t.is_pinned() for t in [*existing.values(), *weights.fresh.values()])
        assert not any(tensors[name].is_pinned() for name in ("0.weight", "0.bias"))
        assert all(torch.equal(t.to("cuda").cpu(), t) for t in tensors.values())  # the module's own still copy
    finally:
        weights.unlock()


_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.slow
@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, _GPU])])
def test_where_the_modules_weights_live_after_each_fit(accelerator, tmp_path):
    """On the CPU the module keeps its own tensors. On a GPU, its first fit gives it stagesafe's own pages
    (its C-allocator tensors cannot be page-locked), unlocked once the call is over; the next fit writes into
    them in place. Either way the module equals the handoff bitwise after each fit."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "host_pages.py")
    gpu = {"DS_ACCELERATOR": None} if accelerator == "gpu" else None  # DeepSpeed picks the GPU
    done = run_script(script, [accelerator, str(tmp_path)], timeout=300, env=gpu)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    before, first, second = seen["before"], seen["first"], seen["second"]
    assert len(before["names"]) == 7 and before["own_pages"] == [] and before["pinned"] == []
    assert first["equals_handoff"] and second["equals_handoff"]
    assert first["pinned"] == second["pinned"] == []  # nothing of the module stays page-locked
    assert second["addresses"] == first["addresses"]  # the second fit wrote into the first one's tensors
    if accelerator == "cpu":
        assert first["own_pages"] == [] and first["addresses"] == before["addresses"]
    else:
        assert first["own_pages"] == first["names"] == second["own_pages"]
