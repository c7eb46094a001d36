"""A stage's end, planned and prepared at its entry: the handoff's plan in the dtypes it holds, the host memory the
end copies into (the module's own tensors in place; on a GPU, the C allocator's moved into pages of their own),
the last fit's kept state let go as a fit starts; on the CPU, and on a GPU."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _launch import run_script
from torch import nn

from stagesafe.stages.history import KeptTraining, fingerprint, new_history, state_tensors
from stagesafe.stages.stage_end import StageEnd, handoff_specs


def _end(**kwargs) -> StageEnd:
    options = {"device": torch.device("cpu"), "max_shard_size": 10**9, "writers": 1, "training": True,
               "keep_optimizer_state": True, "exclude_frozen": False, "stage": "fit", **kwargs}
    return StageEnd(**options)


def _module() -> nn.Module:
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2).to(torch.bfloat16))
    module[1].weight.requires_grad_(False)  # frozen: it comes back from the engine as it went in
    return module


def _original(module: nn.Module) -> dict:
    return {n: (t.dtype, t.device) for n, t in state_tensors(module).items()}


SIXTEEN = {"3.weight", "3.bias"}  # trained in bf16: the handoff holds their fp32 masters


def _history(module: nn.Module):
    history = new_history(module)
    history.note_names(state_tensors(module))
    return history


def _prepared(module: nn.Module, end: StageEnd, masters: dict | None = None, built: set | None = None) -> dict:
    entry = dict(state_tensors(module))
    history = _history(module)
    end.plan_for(module, entry, original=history.original, built=built or set(), kept=set(masters or {}))
    end.prepare_weights(module, entry, history, built=built or set(), masters=masters or {})
    end.engine_built(None, module)  # asks the host (one process here), then makes the rest ready
    return entry


def test_the_plan_made_at_entry_holds_the_dtypes_the_handoff_will_hold():
    module = _module()
    end = _end()
    entry = _prepared(module, end)
    specs = end.plan.tensors
    assert {n for n, s in specs.items() if s["dtype"] == "float32"} == set(entry) - {"2.num_batches_tracked"}
    assert specs["2.num_batches_tracked"]["dtype"] == "int64" and specs["3.weight"]["shape"] == [2, 3]
    assert end.written_here == set(entry)  # one writing rank: every stored name
    handed_off = {n: (t.float() if n in SIXTEEN else t) for n, t in entry.items()}  # what the end gives the writer
    assert end.plan_matching(handed_off) is end.plan  # the plan made at entry is the one written
    other = {**handed_off, "3.weight": entry["3.weight"]}  # a stage that ended with bf16 after all: planned again
    first = end.plan
    again = end.plan_matching(other)
    assert again is not first and again is end.plan and again.tensors["3.weight"]["dtype"] == "bfloat16"


def test_a_fit_copies_fp32_masters_into_the_modules_own_tensors_and_16_bit_ones_into_new_fp32_ones():
    module = _module()
    end = _end()
    entry = _prepared(module, end)
    weights = end.weights_ready()
    assert sorted(weights) == ["0.bias", "0.weight", "1.bias", "2.bias", "2.weight", "3.bias", "3.weight"]
    assert all(weights[n] is entry[n] for n in ("0.weight", "0.bias", "1.bias"))  # in place
    for name in SIXTEEN:  # the module holds bf16: its fp32 master lands in host memory of its own
        assert weights[name].dtype == torch.float32 and weights[name].shape == entry[name].shape
    assert end.private_buffers() == {}  # on the CPU the gathered masters are the private copies


def test_the_kept_masters_of_16_bit_parameters_take_the_next_ones_in_place():
    module = _module()
    masters = {n: state_tensors(module)[n].float() for n in SIXTEEN}
    end = _end()
    _prepared(module, end, masters=masters)
    weights = end.weights_ready()
    assert all(weights[n] is masters[n] for n in SIXTEEN)  # no second copy of them


def test_a_parameter_zero_init_built_gets_new_host_memory_of_its_full_shape():
    module = _module()
    module[0].weight.ds_shape = torch.Size([3, 4])
    module[0].weight.data = torch.empty(0)  # a ZeRO-3 placeholder: only the engine has its value
    end = _end()
    entry = _prepared(module, end, built={"0.weight"})
    new = end.weights_ready()["0.weight"]
    assert new.shape == (3, 4) and new.dtype == torch.float32 and new.data_ptr() != entry["0.weight"].data_ptr()
    specs, _ = handoff_specs(module, entry, original=_original(module), built={"0.weight"}, masters=set())
    assert specs["0.weight"]["shape"] == [3, 4]


def test_nothing_is_prepared_where_nothing_trains_and_tied_names_are_planned_once():
    module = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    module[1].weight = module[0].weight
    for param in module.parameters():
        param.requires_grad_(False)
    end = _end()
    entry = dict(state_tensors(module))
    end.plan_for(module, entry, original=_original(module), built=set())
    end.prepare_weights(module, entry, _history(module), built=set(), masters={})
    assert end.weights_ready() is None
    assert end.plan.aliases == {"1.weight": "0.weight"}
    assert end.written_here == {"0.weight", "0.bias", "1.bias"}  # a tied name is its first's


def test_a_fit_lets_the_last_fits_kept_state_go_as_it_starts_and_says_so_if_it_keeps_none():
    module = _module()
    history = new_history(module)
    moments = torch.ones(10)
    history.kept = KeptTraining(fingerprint(state_tensors(module)), checkpoint={"optim": {"exp_avg": moments}})
    _end(training=False).take_over_kept_state(history)
    assert history.kept.checkpoint is not None  # an inference stage keeps it: the weights stay
    _end().take_over_kept_state(history)
    assert history.kept.checkpoint is None and "let it go as it started" in history.kept.missing


def test_a_fit_that_keeps_no_optimizer_state_says_why_without_asking_the_engine():
    end = _end(keep_optimizer_state=False)
    assert end.keep_engine_state(engine=None) == (
        None, "StageSafeDeepSpeedStrategy(keep_optimizer_state=False) keeps none between Trainer calls"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_c_allocators_tensors_move_into_pages_of_their_own_stagesafes_are_locked_in_place():
    from stagesafe.stages.page_lock import empty

    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(4096, 2048, bias=False))  # 32 MiB: maybe mapped on its own
    ours = empty(module[1].weight.shape, torch.float32).copy_(module[1].weight.detach())
    module[1].weight = nn.Parameter(ours)  # as a stage's end leaves it: stagesafe's own pages
    tensors = state_tensors(module)
    before = {n: t.clone() for n, t in tensors.items()}
    end = _end(device=torch.device("cuda", torch.cuda.current_device()))
    entry = dict(tensors)
    history = _history(module)
    history.fingerprint = fingerprint(tensors)  # as a handoff that holds these weights
    end.plan_for(module, entry, original=history.original, built=set())
    end.prepare_weights(module, entry, history, built=set(), masters={})
    end.engine_built(None, module)
    end.weights.ready()  # as a stage long enough for every tensor to move
    weights = end.weights_ready()
    try:
        assert weights["1.weight"].data_ptr() == tensors["1.weight"].data_ptr()  # in place
        moved = sorted(end.weights.swapped)
        assert moved == ["0.bias", "0.weight"] and all(entry[n] is weights[n] for n in moved)
        assert history.fingerprint == fingerprint(entry)  # what was known of the old tensors holds of the new
        for name in moved:  # the C allocator's: moved into pages of their own, same values
            assert weights[name].data_ptr() != tensors[name].data_ptr() and torch.equal(weights[name], before[name])
        assert all(t.is_pinned() for t in [*weights.values(), *end.private_buffers().values()])
        assert not any(tensors[name].is_pinned() for name in ("0.weight", "0.bias"))
        assert all(torch.equal(t.to("cuda").cpu(), t) for t in tensors.values())  # the module's own still copy
    finally:
        end.unlock()


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
