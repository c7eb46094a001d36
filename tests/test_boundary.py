"""One Trainer call's boundary, in this process: a plain torch module with no engine (what the boundary does
around one), then DeepSpeed's own ZeRO-3 engine on one gloo rank. Real files, the real writer and key-value
store (torch.distributed's HashStore)."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

import stagesafe
from _launch import end_process_group
from _tensors import assert_bitwise_equal
from stagesafe.errors import (
    HandoffNotFoundError,
    InvalidArgumentError,
    StaleDeepSpeedStateError,
    StorageTransferError,
)
from stagesafe.restore import assign_values
from stagesafe.stages.boundary import StageBoundary, StageOptions
from stagesafe.stages.channel import JobChannel
from stagesafe.stages.history import HandoffTarget, history_of
from stagesafe.stages.writer import HandoffWriter


def _net() -> nn.Module:
    """Parameters in fp32 and bf16, fp32 and int64 buffers."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2).to(torch.bfloat16))


def _writer(uri: str) -> HandoffWriter:
    channel = JobChannel(dist.HashStore(), rank=0, world=1, prefix="boundary", timeout=30.0)
    return HandoffWriter(channel, uri, writers=1, timeout=30.0)


def _boundary(module: nn.Module, uri: str, writer: HandoffWriter, stage: str = "validate", **kwargs) -> StageBoundary:
    options = StageOptions(stage, **{**kwargs, "fresh": frozenset(kwargs.get("fresh", ()))})
    return StageBoundary(module, HandoffTarget(uri=uri), options, writer=writer)


def _end(boundary: StageBoundary, engine=None, *, trained: bool = False, gather: bool = True, **kwargs):
    return boundary.exit(engine, trained=trained, weights_from=kwargs.pop("weights_from", {}), gather=gather,
                         background=kwargs.pop("background", True), **kwargs)


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module.state_dict().items()}


def _objects(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.state_dict(keep_vars=True))


def _stage(module: nn.Module, uri: str, writer: HandoffWriter, stage: str = "validate", **kwargs):
    """A whole stage with no engine: enter, exit; returns the report."""
    boundary = _boundary(module, uri, writer, stage, **kwargs)
    boundary.enter()
    report = _end(boundary, trained=stage == "fit")
    boundary.place_meta()
    return report


# -- entering ---------------------------------------------------------------------------------------------------
def test_enter_refuses_a_module_with_stale_deepspeed_state_and_changes_nothing(tmp_path):
    module, writer = _net(), _writer(str(tmp_path / "h"))
    module[0].weight.ds_id = 7  # what an earlier engine leaves on a parameter
    objects, values = _objects(module), _values(module)
    stale = r"parameter '0.weight' carries DeepSpeed attributes \['ds_id'\]"
    with pytest.raises(StaleDeepSpeedStateError, match=stale):
        _boundary(module, str(tmp_path / "h"), writer).enter()
    assert history_of(module) is None and not writer.pending and not (tmp_path / "h").exists()
    assert _objects(module).keys() == objects.keys()
    assert all(_objects(module)[n] is t for n, t in objects.items())
    assert_bitwise_equal(_values(module), values)
    assert module[0].weight.ds_id == 7


def test_a_parameter_zero_init_built_in_this_call_is_not_stale_and_only_the_engine_has_its_value(tmp_path, caplog):
    module, writer = _net(), _writer(str(tmp_path / "h"))
    module[0].weight.ds_id = 7  # zero.Init partitioned it in this call's configure_model
    boundary = _boundary(module, str(tmp_path / "h"), writer, fresh={id(module[0].weight)})
    boundary.enter()
    assert not writer.pending  # only the engine has that parameter's value: nothing to write from at entry
    with caplog.at_level(logging.ERROR):
        report = _end(boundary)  # no engine to ask for it
    assert "before the weights of ['0.weight'] (built by zero.Init) could be gathered" in caplog.text
    assert not report.wrote


def test_a_module_of_meta_tensors_needs_the_meta_mode_and_a_handoff(tmp_path):
    with torch.device("meta"):
        module = _net()
    with pytest.raises(InvalidArgumentError, match="between_stages='meta'"):
        _boundary(module, str(tmp_path / "h"), _writer(str(tmp_path / "h"))).enter()
    with pytest.raises(InvalidArgumentError, match="no handoff holds its weights: pass resume_from=URI"):
        uri = str(tmp_path / "h")
        _boundary(module, uri, _writer(uri), meta=True, materialize=lambda values: None).enter()


def test_a_first_stage_resumes_from_a_handoff_into_the_same_parameter_objects(tmp_path):
    source = str(tmp_path / "earlier")
    saved = {n: (v + 1 if v.is_floating_point() else v + 3) for n, v in _values(_net()).items()}
    stagesafe.save_state_dict(saved, source)
    module, writer = _net(), _writer(str(tmp_path / "h"))
    objects = _objects(module)
    boundary = _boundary(module, str(tmp_path / "h"), writer)
    boundary.enter(resume_from=HandoffTarget(uri=source))
    assert all(_objects(module)[n] is t for n, t in objects.items())
    assert_bitwise_equal(_values(module), saved)
    assert history_of(module).weights_from == {"resumed_from": source}
    _end(boundary)
    writer.join()
    assert_bitwise_equal(stagesafe.load_state_dict(str(tmp_path / "h")), saved)
    assert stagesafe.read_manifest(str(tmp_path / "h"))["metadata"]["resumed_from"] == source


# -- leaving ----------------------------------------------------------------------------------------------------
def test_an_inference_stage_writes_its_weights_while_its_loop_runs_and_once(tmp_path):
    module, uri = _net(), str(tmp_path / "h")
    writer = _writer(uri)
    objects, values = _objects(module), _values(module)
    boundary = _boundary(module, uri, writer)
    boundary.enter()
    assert not writer.pending  # not before the loop: Lightning may still fail on its ckpt_path
    boundary.loop_started()
    assert writer.pending  # started as the loop starts, from the tensors the boundary kept at entry
    report = _end(boundary)
    assert report.wrote and report.clean and not writer.pending  # the stage's end joined it
    assert all(_objects(module)[n] is t for n, t in objects.items())
    assert_bitwise_equal(stagesafe.load_state_dict(uri), values)
    assert not _stage(module, uri, writer, "test").wrote  # the handoff holds these weights already


def test_the_end_gives_back_the_same_parameters_in_their_dtype_and_drops_what_the_engine_added(tmp_path):
    module, writer = _net(), _writer(str(tmp_path / "h"))
    kept_hook = module[0].register_forward_hook(lambda *args: None)  # the user's: it stays
    module[0].weight.users_note = "mine"
    objects, values = _objects(module), _values(module)
    boundary = _boundary(module, str(tmp_path / "h"), writer, "fit", training=True)
    boundary.enter()
    for param in module.parameters():  # what a ZeRO-3 engine leaves: empty 16-bit placeholders, ds_* attributes
        param.data = torch.empty(0, dtype=torch.bfloat16)
        param.ds_shape = (1,)
    module[1].running_mean.data = module[1].running_mean.to(torch.bfloat16)
    module[1].ds_external = True
    added_hook = module[2].register_forward_pre_hook(lambda *args: None)
    report = _end(boundary, trained=True)  # no engine: the weights the stage started with
    assert report.clean and report.stale_problems == []
    assert all(_objects(module)[n] is t for n, t in objects.items())  # each parameter and buffer object stays
    assert_bitwise_equal(_values(module), values)  # dtypes included: fp32, bf16, int64
    assert all(t.device.type == "cpu" for t in _objects(module).values())
    assert not any(hasattr(p, "ds_shape") for p in module.parameters()) and not hasattr(module[1], "ds_external")
    assert kept_hook.id in module[0]._forward_hooks and added_hook.id not in module[2]._forward_pre_hooks
    assert module[0].weight.users_note == "mine"
    writer.join()


def test_a_checkpoint_loaded_during_the_stage_is_what_the_module_and_the_handoff_get(tmp_path):
    module, uri = _net(), str(tmp_path / "h")
    writer = _writer(uri)
    loaded = {n: (v * 2 if v.is_floating_point() else v + 5) for n, v in _values(module).items()}
    boundary = _boundary(module, uri, writer)
    boundary.enter()
    boundary.checkpoint_loaded(loaded, module, training=False)  # a plain module: loaded where it is
    report = _end(boundary, weights_from={"stage": "validate", "global_step": 3}, background=False)
    assert report.wrote and not writer.pending  # in the foreground: joined before exit returned
    assert_bitwise_equal(_values(module), loaded)
    assert_bitwise_equal(stagesafe.load_state_dict(uri), loaded)
    metadata = stagesafe.read_manifest(uri)["metadata"]
    assert (metadata["stage"], metadata["global_step"]) == ("validate", 3)
    assert history_of(module).weights_from == {"stage": "validate", "global_step": 3}


def test_the_weights_a_module_brings_name_the_first_call_that_writes_them(tmp_path):
    """A validate before any fit writes the module's own weights: its manifest names that call and step, as a
    fit's names its own (the commit line then reads "validate, step 0", not "weights")."""
    module, uri = _net(), str(tmp_path / "h")
    writer = _writer(uri)
    boundary = _boundary(module, uri, writer)
    boundary.enter(weights_from={"stage": "validate", "global_step": 0})
    report = _end(boundary, weights_from={"stage": "validate", "global_step": 0}, background=False)
    assert report.wrote
    metadata = stagesafe.read_manifest(uri)["metadata"]
    assert (metadata["stage"], metadata["global_step"]) == ("validate", 0)
    _stage(module, uri, writer, "test")  # a later call finds its weights in the handoff and writes nothing
    assert stagesafe.read_manifest(uri)["metadata"]["stage"] == "validate"


def test_with_a_rank_elsewhere_rank_zero_writes_alone_and_the_next_stage_writes_again(tmp_path):
    module, uri = _net(), str(tmp_path / "h")
    writer = _writer(uri)
    values = _values(module)
    boundary = _boundary(module, uri, writer, "fit", training=True)
    boundary.enter()
    report = _end(boundary, trained=True, gather=False)
    assert report.wrote and not writer.pending  # written now, not by the background writer
    assert_bitwise_equal(stagesafe.load_state_dict(uri), values)
    assert history_of(module).fingerprint is None  # forgotten: the other ranks may not have seen it
    assert _stage(module, uri, writer).wrote
    writer.join()


def test_a_failed_last_write_is_raised_once_the_module_is_plain_again(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    module, writer = _net(), _writer(str(tmp_path / "file" / "h"))
    objects, values = _objects(module), _values(module)
    boundary = _boundary(module, str(tmp_path / "file" / "h"), writer)
    boundary.enter()  # its write starts, and fails in the background
    for param in module.parameters():
        param.data = torch.empty(0)
    with pytest.raises(StorageTransferError, match="Not a directory"):
        _end(boundary, background=False)  # the write at entry failed; the end's own write too, later
    assert all(_objects(module)[n] is t for n, t in objects.items())
    assert_bitwise_equal(_values(module), values)
    assert boundary.report.clean and history_of(module).fingerprint is None


def test_a_handoff_deleted_between_stages_is_written_again(tmp_path, caplog):
    module, uri = _net(), str(tmp_path / "h")
    writer = _writer(uri)
    _stage(module, uri, writer)
    writer.join()
    shutil.rmtree(uri)
    with caplog.at_level(logging.WARNING):
        assert _stage(module, uri, writer, "test").wrote
    assert "writes the module's weights there again" in caplog.text
    writer.join()
    assert_bitwise_equal(stagesafe.load_state_dict(uri), _values(module))


# -- between stages on the meta device ----------------------------------------------------------------------------
def test_in_meta_mode_the_module_holds_meta_tensors_and_the_next_engine_is_built_from_the_handoff(tmp_path):
    module, uri = _net(), str(tmp_path / "h")
    writer = _writer(uri)
    values = _values(module)
    fed: dict[str, torch.Tensor] = {}

    def materialize(handoff) -> None:  # what the strategy's ZeRO-3 partitioning does, without an engine
        fed.update({name: handoff[name] for name in handoff})
        assign_values(module, {name: handoff[name].clone() for name in handoff})

    _stage(module, uri, writer, meta=True, materialize=materialize)  # its weights are in no handoff: written
    assert all(t.device.type == "meta" for t in _objects(module).values())
    assert_bitwise_equal(stagesafe.load_state_dict(uri), values)
    report = _stage(module, uri, writer, "test", meta=True, materialize=materialize)
    assert_bitwise_equal(fed, values)
    assert not report.wrote and all(t.device.type == "meta" for t in _objects(module).values())
    shutil.rmtree(uri)
    with pytest.raises(HandoffNotFoundError, match="the handoff that holds its weights is gone or damaged"):
        _boundary(module, uri, writer, "test", meta=True, materialize=materialize).enter()


# -- around DeepSpeed's own ZeRO-3 engine, on one gloo rank in this process ---------------------------------------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A gloo process group of one rank, DeepSpeed on the CPU; both undone afterwards."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    from stagesafe.strategy_bases.cpu_strategy import use_deepspeed_cpu_accelerator

    before = get_accelerator()
    use_deepspeed_cpu_accelerator()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOCAL_RANK", "0")
        store = tmp_path_factory.mktemp("rendezvous") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            yield
        finally:
            end_process_group()
            set_accelerator(before)


def _engine(module: nn.Module):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
              "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)  # lr 0: the trained weights are the entry's
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("meta", [False, True], ids=["cpu", "meta"])
def test_a_fit_hands_off_the_exact_fp32_masters_and_gives_the_module_back_plain(one_rank, tmp_path, meta):
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2).to(torch.bfloat16))
    uri = str(tmp_path / "h")
    writer = _writer(uri)
    objects, values = _objects(module), _values(module)
    memory = {n: t.data_ptr() for n, t in objects.items() if t.dtype == torch.float32}
    boundary = _boundary(module, uri, writer, "fit", training=True, device=torch.device("cpu"), meta=meta,
                         materialize=lambda handoff: None)
    boundary.enter()
    history_of(module).weights_from = {"stage": "validate", "global_step": 0}  # what an earlier stage left
    engine = _engine(module)  # casts the module to bf16 and partitions it
    boundary.engine_built(engine, training=True)  # the masters get the exact fp32 values, not bf16-rounded ones
    planned = boundary.end.plan  # made as the stage entered, before the engine cast anything
    report = _end(boundary, engine, trained=True, weights_from={"stage": "fit", "global_step": 1}, background=False)
    boundary.place_meta()
    assert report.wrote and report.clean
    handoff = stagesafe.load_state_dict(uri)
    manifest = stagesafe.read_manifest(uri)
    if not meta:  # the plan made at entry is the one written: the same shards, the bf16 layer's as fp32
        assert boundary.end.plan is planned
        assert sorted(map(sorted, _names_per_shard(manifest))) == sorted(map(sorted, planned.shards.values()))
        assert {n: t["dtype"] for n, t in planned.tensors.items()} == {
            "0.weight": "float32", "0.bias": "float32", "1.weight": "float32", "1.bias": "float32"}
    assert_bitwise_equal(handoff, {n: v.float() for n, v in values.items()})  # fp32, the bf16 layer's too
    metadata = stagesafe.read_manifest(uri)["metadata"]
    assert (metadata["stage"], metadata["global_step"]) == ("fit", 1)  # this fit's, in both modes
    kept = history_of(module).kept
    assert kept is not None and kept.checkpoint and kept.missing == ""
    if meta:
        assert all(t.device.type == "meta" for t in _objects(module).values()) and kept.masters == {}
        assert [t.dtype for t in _objects(module).values()] == [v.dtype for v in values.values()]
    else:
        assert all(_objects(module)[n] is t for n, t in objects.items())
        assert_bitwise_equal(_values(module), values)  # each in its own dtype again
        assert_bitwise_equal(kept.masters, {n: handoff[n] for n in ("1.weight", "1.bias")})
        assert {n: t.data_ptr() for n, t in _objects(module).items() if n in memory} == memory  # copied in place
        # a fit that some rank left early: the weights it started with are written, the bf16 layer's as its masters
        again = _boundary(module, str(tmp_path / "again"), _writer(str(tmp_path / "again")), "fit", training=True)
        again.enter()
        _end(again, trained=True, gather=False)
        assert_bitwise_equal(stagesafe.load_state_dict(str(tmp_path / "again")), handoff)


@pytest.mark.slow
def test_a_fit_with_a_background_write_leaves_the_kept_state_copy_to_the_writers_device_thread(one_rank, tmp_path):
    """The call does not wait for the kept optimizer state's host memory nor its copy: the writer's device
    thread copies it after the engine is gone, and it is then DeepSpeed's checkpoint as it was. Its fp32 master
    partitions are kept as recipes, built again from the module's values; on the CPU its moments are the engine's
    own tensors, which nothing writes once it is gone: not held twice."""
    from stagesafe.zero.engine import PartitionRecipe, built_partitions, checkpoint_files, tensors_in

    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    uri = str(tmp_path / "h")
    writer = _writer(uri)
    boundary = _boundary(module, uri, writer, "fit", training=True, device=torch.device("cpu"))
    boundary.enter()
    engine = _engine(module)
    boundary.engine_built(engine, training=True)
    expected = checkpoint_files(engine, exclude_frozen=False)  # the fp32 partitions as tensors
    engine_memory = {t.data_ptr() for t in tensors_in(engine.optimizer.state_dict())}
    report = _end(boundary, engine, trained=True, weights_from={"stage": "fit", "global_step": 1}, background=True)
    writer.join()
    assert "kept_state_copy" in report.phases and "kept_host_memory_ready" not in report.phases
    assert 0 <= report.phases["consolidate_device_wait"] <= report.phases["consolidate"]  # a part of it
    kept = history_of(module).kept
    assert kept is not None and kept.missing == "" and sorted(kept.checkpoint) == sorted(expected)
    recipes = [r for state in kept.checkpoint.values() for r in _recipes_in(state)]
    assert recipes and all(isinstance(r, PartitionRecipe) for r in recipes)
    built = built_partitions(kept.checkpoint, {n: t.detach() for n, t in module.state_dict().items()})
    for name, state in expected.items():
        got, want = list(tensors_in(built[name])), list(tensors_in(state))
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            assert_bitwise_equal({"t": a}, {"t": b})
        held = [t for t in tensors_in(kept.checkpoint[name]) if t.numel() > 1]
        assert all(t.device.type == "cpu" and t.data_ptr() in engine_memory for t in held)  # the engine's own


def _names_per_shard(manifest: dict) -> list[list[str]]:
    shards: dict[str, list[str]] = {}
    for name, file in manifest["weight_map"].items():
        shards.setdefault(file, []).append(name)
    return list(shards.values())


def _recipes_in(state):
    if isinstance(state, dict):
        for value in state.values():
            yield from _recipes_in(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _recipes_in(value)
    elif not isinstance(state, torch.Tensor) and hasattr(state, "build"):
        yield state


def test_a_call_that_failed_before_any_step_writes_no_handoff_and_the_next_call_does(tmp_path, caplog):
    module, uri = _net(), str(tmp_path / "h")
    writer = _writer(uri)
    values = _values(module)
    boundary = _boundary(module, uri, writer, "test")
    boundary.enter()
    with caplog.at_level(logging.INFO, logger="stagesafe"):
        report = _end(boundary, background=False, failed=True)  # e.g. a ckpt_path that does not exist
    assert not report.wrote and not os.path.exists(uri)
    assert "the test call failed before any optimizer step: no handoff written" in caplog.text
    assert_bitwise_equal(_values(module), values)
    assert _stage(module, uri, writer, "test").wrote  # the module's weights are written by the next call
    writer.join()
    assert_bitwise_equal(stagesafe.load_state_dict(uri), values)


def test_the_collector_makes_no_passes_during_a_boundary_and_runs_again_after(tmp_path):
    module = nn.Sequential(*[nn.Linear(2, 2) for _ in range(1500)])  # 3000 tensors: thousands of allocations
    writer, passes = _writer(str(tmp_path / "h")), []
    boundary = _boundary(module, str(tmp_path / "h"), writer, "fit", training=True)

    def count(phase, info):
        # automatic passes (a gc.collect() is a full one) of this thread: once exit() has returned, the write it
        # started in the background allocates too, and may start one before the count below is read
        if phase == "start" and info["generation"] < 2 and threading.current_thread() is threading.main_thread():
            passes.append(info["generation"])

    gc.callbacks.append(count)
    try:
        boundary.enter()
        during_enter = len(passes)
        gc.collect(1)
        passes.clear()
        report = _end(boundary, trained=True)
        during_exit = len(passes)
        assert gc.isenabled()
        [[] for _ in range(5000)]  # and the collector runs again
    finally:
        gc.callbacks.remove(count)
    writer.join()
    # at most the one pass as the collector resumes (dozens each, without the pause)
    assert report.wrote and during_enter <= 1 and during_exit <= 1 and len(passes) > during_exit
