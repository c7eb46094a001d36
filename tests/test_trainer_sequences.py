"""End to end: sequences of Trainer calls on one module, 2 CPU ranks (gloo), stagesafe against stock.

Two script runs per session (Lightning re-runs the script for rank 1): one with StageSafeDeepSpeedStrategy,
one with the stock strategy (Lightning's, with only the CPU refusal lifted). Every stock case is the
control that shows the failure stagesafe removes.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import stagesafe
import torch

from stagesafe import load_state_dict, read_manifest, restore, verify

from _launch import run_script
from _tensors import assert_bitwise_equal

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "trainer_sequences.py")
sys.path.insert(0, os.path.join(HERE, "scripts"))
from toy import HIDDEN, ToyModule, state_digest  # noqa: E402
from trainer_sequences import STAGES  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _run(tmp_path_factory, strategy: str, extra_cases: list | None = None, built_in=("init", "configure_model")) -> dict:
    root = tmp_path_factory.mktemp(f"seq-{strategy}")
    spec = {
        "accelerator": "cpu",
        "devices": 2,
        "root": str(root),
        "case_groups": [
            {"kind": "matrix", "strategy": strategy, "precision": "bf16-mixed", "built_in": list(built_in)},
            {"kind": "scenario", "strategy": strategy, "precision": "bf16-mixed"},
        ],
        "cases": extra_cases or [],
    }
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps(spec))
    run_script(SCRIPT, [str(spec_path), str(root / "out")], timeout=540, cwd=str(root))
    ranks = [json.loads((root / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    return {"root": root, "rank0": ranks[0], "rank1": ranks[1]}


@pytest.fixture(scope="module")
def stagesafe_run(tmp_path_factory):
    return _run(tmp_path_factory, "stagesafe")


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory):
    lightning_cpu = {"name": "lightning:cpu", "strategy": "lightning", "stages": ["validate"]}
    return _run(tmp_path_factory, "stock", [lightning_cpu], built_in=("init",))  # the control asserts these


BUFFER_BYTES = HIDDEN * 4  # ToyModule's only tensor that is not a trainable parameter: a buffer of HIDDEN fp32
PAIRS = [(a, b, mode) for mode in ("one", "per_call") for a in STAGES for b in STAGES]


def _stages(run: dict, name: str, rank: int = 0) -> list[dict]:
    return run[f"rank{rank}"][name]["stages"]


def _assert_clean(stage: dict, user_hooks: int = 1, dtype: str = "torch.float32") -> None:
    assert stage["error"] is None, stage.get("traceback")
    probe = stage["probe"]
    assert probe["ds_attrs"] == 0
    assert probe["deepspeed_hooks"] == 0
    assert probe["user_hooks"] == user_hooks
    assert probe["min_numel"] > 0
    assert probe["dtypes"] == [dtype]
    assert probe["devices"] == ["cpu"]
    assert stage["boundary"]["clean"] is True


@pytest.mark.parametrize("built", ["", ":configured"], ids=["built_in_init", "built_in_configure_model"])
@pytest.mark.parametrize("first,second,mode", PAIRS, ids=[f"{a}>{b}:{m}" for a, b, m in PAIRS])
def test_every_pair_leaves_a_clean_module_holding_the_handoff(stagesafe_run, first, second, mode, built):
    """Layers built in __init__, or in configure_model under zero.Init (partitioned before the first engine)."""
    name = f"stagesafe:{first}>{second}:{mode}{built}"
    for rank in (0, 1):
        for stage in _stages(stagesafe_run, name, rank):
            # layers built in configure_model stay in the dtype Lightning built them in (bf16 here), as stock
            # keeps them; those of __init__ come back in theirs (float32)
            _assert_clean(stage, dtype="torch.bfloat16" if built else "torch.float32")
            # the background writer copies the trained fp32 parameters itself: the call only waited to clone
            # the untrained buffer, if this rank writes it. (16-bit weights are cloned for the writer.)
            if not built:
                assert stage["boundary"]["copied_while_waiting"] <= BUFFER_BYTES
    final = _stages(stagesafe_run, name)[-1]["probe"]["digest"]
    assert final == _stages(stagesafe_run, name, rank=1)[-1]["probe"]["digest"]
    # written by 2 ranks, read by this single process: the same bits the module holds
    uri = stagesafe_run["rank0"][name]["handoff_uri"]
    fresh = ToyModule().to(torch.bfloat16 if built else torch.float32)
    assert state_digest(restore(fresh, uri)) == final
    if built and first == second == "fit":  # the layers zero.Init built are trained, and cross the boundary
        fits = _stages(stagesafe_run, name)
        assert fits[0]["probe"]["digest"] != fits[1]["probe"]["digest"]


@pytest.mark.parametrize("first,second,mode", PAIRS, ids=[f"{a}>{b}:{m}" for a, b, m in PAIRS])
def test_control_stock_leaves_a_hollow_module_with_deepspeed_state(stock_run, first, second, mode):
    stages = _stages(stock_run, f"stock:{first}>{second}:{mode}")
    for stage in stages:
        assert stage["error"] is None  # on CPU the stock sequence runs; on GPU it crashes (docs/gpu-results.md)
        assert stage["probe"]["min_numel"] == 0, "weights should be empty ZeRO-3 placeholders"
        assert stage["probe"]["ds_attrs"] > 0
        assert stage["probe"]["deepspeed_hooks"] > 0


def test_deepspeed_hooks_pile_up_without_stagesafe_and_not_with_it(stock_run, stagesafe_run):
    stock = [s["probe"]["deepspeed_hooks"] for s in _stages(stock_run, "stock:hooks")]
    assert stock[1] > stock[0] and stock[3] > stock[0], stock  # fit > fit > validate > fit
    for stage in _stages(stagesafe_run, "stagesafe:hooks"):
        _assert_clean(stage)


def test_new_root_module_over_the_same_backbone(stock_run, stagesafe_run):
    for case in ("new_root_validate_fit", "new_root_fit_fit"):
        stages = _stages(stagesafe_run, f"stagesafe:{case}")
        _assert_clean(stages[0], user_hooks=1)
        _assert_clean(stages[1], user_hooks=2)  # each root registered its own hook on the backbone
        stock = _stages(stock_run, f"stock:{case}")
        # the new engine adopts the backbone's stale bf16 partitions next to the new head's fp32 parameters
        assert stock[1]["error"].startswith("AssertionError"), stock[1]["error"]
        assert "assert len(set(t.dtype for t in tensors)) == 1" in stock[1]["traceback"]


def test_lr0_fit_returns_the_input_weights_bitwise(stock_run, stagesafe_run):
    (stage,) = _stages(stagesafe_run, "stagesafe:lr0")
    _assert_clean(stage)
    assert stage["probe"]["digest"] == stagesafe_run["rank0"]["stagesafe:lr0"]["initial_digest"]
    assert stage["master_max_abs_diff"] == 0.0
    # control: stock builds its fp32 masters from the bf16-cast module
    (stock,) = _stages(stock_run, "stock:lr0")
    assert stock["master_max_abs_diff"] > 1e-4


def test_layers_of_configure_model_beside_layers_of_init_run_in_bf16_and_keep_their_fp32_values(stock_run, stagesafe_run):
    """DeepSpeed casts a module to bf16 only where zero.Init built none of its parameters: the head built in
    ``__init__`` stayed fp32 beside the bf16 backbone and the first forward failed. Cast for the engine, it comes
    back in fp32 with its exact values (lr 0), and the fit's masters started from them."""
    name = "stagesafe:configured_beside_init"
    for rank in (0, 1):
        stages = _stages(stagesafe_run, name, rank)
        assert [s["stage"] for s in stages] == ["validate", "fit", "test"]
        for stage in stages:
            assert stage["error"] is None, stage.get("traceback")
            assert stage["probe"]["dtypes"] == ["torch.bfloat16", "torch.float32"]  # backbone, head: as built
            assert stage["probe"]["ds_attrs"] == 0 and stage["probe"]["min_numel"] > 0
        assert stages[1]["master_max_abs_diff"] == 0.0
    torch.manual_seed(0)  # the head as the script built it
    head = ToyModule(in_configure_model=True, extra_head=True).extra_head
    handoff = load_state_dict(stagesafe_run["rank0"][name]["handoff_uri"])
    assert_bitwise_equal({k: handoff[f"extra_head.{k}"] for k in ("weight", "bias")}, dict(head.state_dict()))
    (stock, *_) = _stages(stock_run, "stock:configured_beside_init")  # control: stock's first forward fails
    assert "must have the same dtype" in stock["error"], stock["error"]


def test_fit_validate_fit_equals_two_epochs_bitwise(stagesafe_run):
    split = _stages(stagesafe_run, "stagesafe:continuity_split")
    whole = _stages(stagesafe_run, "stagesafe:continuity_whole")
    for stage in split + whole:
        _assert_clean(stage)
    assert split[-1]["probe"]["digest"] == whole[-1]["probe"]["digest"]
    assert split[0]["probe"]["digest"] != whole[-1]["probe"]["digest"]  # the second fit did train


def test_frozen_parameters_cross_the_boundary_exactly(stagesafe_run):
    for stage in _stages(stagesafe_run, "stagesafe:frozen"):
        _assert_clean(stage)
    torch.manual_seed(0)
    initial = ToyModule().state_dict()
    after = load_state_dict(stagesafe_run["rank0"]["stagesafe:frozen"]["handoff_uri"])
    for name in ("backbone.hidden.weight", "backbone.hidden.bias"):
        assert torch.equal(after[name].view(torch.int32), initial[name].view(torch.int32))
    assert not torch.equal(after["backbone.head.weight"], initial["backbone.head.weight"])


def test_checkpoints_best_last_and_resume(stock_run, stagesafe_run):
    stages = _stages(stagesafe_run, "stagesafe:ckpt")
    for stage in stages:
        _assert_clean(stage)
    fit, test_best, validate_last, resumed = stages
    assert test_best["probe"]["digest"] == fit["probe"]["digest"]  # best = end of the only epoch
    assert validate_last["probe"]["digest"] == fit["probe"]["digest"]
    assert resumed["probe"]["digest"] != fit["probe"]["digest"]
    stock = _stages(stock_run, "stock:ckpt")
    assert "_restore_from_bit16_weights" in stock[1]["error"]


@pytest.mark.parametrize("case", ["save_between_stages", "save_between_stages_zero2"])
def test_save_checkpoint_between_stages_writes_a_deepspeed_folder_that_every_reader_reads(
    stock_run, stagesafe_run, case, tmp_path
):
    """trainer.save_checkpoint(path) after fit: a DeepSpeed checkpoint folder, as during a stage, read by
    DeepSpeed's own converter, `stagesafe consolidate` and trainer.test(ckpt_path=path)."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    from stagesafe.cli import main
    from toy import state_digest_of

    stages = _stages(stagesafe_run, f"stagesafe:{case}")
    for stage in stages:
        _assert_clean(stage)
    fitted = stages[0]["probe"]["digest"]
    assert stages[2]["probe"]["digest"] == fitted  # test(ckpt_path=...) ran on the saved weights
    folder = os.path.join(os.path.dirname(stagesafe_run["rank0"][f"stagesafe:{case}"]["handoff_uri"]), "final.ckpt")
    assert open(os.path.join(folder, "latest")).read() == "checkpoint"
    convert_zero_checkpoint_to_fp32_state_dict(folder, str(tmp_path / "converted"), safe_serialization=True)
    converted = load_state_dict_from_hf_folder(tmp_path / "converted")
    assert state_digest_of(converted) == fitted
    assert main(["consolidate", folder, str(tmp_path / "ours"), "-q"]) == 0
    assert state_digest_of(load_state_dict(str(tmp_path / "ours"))) == fitted
    if case == "save_between_stages":
        assert "_restore_from_bit16_weights" in _stages(stock_run, "stock:save_between_stages")[2]["error"]


def load_state_dict_from_hf_folder(folder) -> dict:
    import safetensors.torch

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(safetensors.torch.load_file(os.path.join(folder, name)))
    return out


def test_a_checkpoint_saved_between_stages_continues_training_from_its_weights(stagesafe_run):
    """fit(ckpt_path=...) from such a folder: the weights are the saved ones; the optimizer starts afresh."""
    first, saved, resumed = _stages(stagesafe_run, "stagesafe:save_between_stages_then_fit")
    for stage in (first, saved, resumed):
        _assert_clean(stage, dtype="torch.bfloat16")  # built in configure_model: in the precision's dtype
    assert resumed["probe"]["digest"] != first["probe"]["digest"]  # it trained on
    assert resumed["global_step"] > first["global_step"]  # from the saved loop state
    assert resumed["master_max_abs_diff"] == 0.0  # its fp32 masters started exactly at the saved weights


def test_user_config_is_never_mutated_and_reusable(stock_run, stagesafe_run):
    original = {"zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    for stage in _stages(stagesafe_run, "stagesafe:config_reuse"):
        _assert_clean(stage)
    assert stagesafe_run["rank0"]["stagesafe:config_reuse"]["user_config_after"] == original
    stock = stock_run["rank0"]["stock:config_reuse"]
    assert "Do not set `gradient_accumulation_steps`" in stock["stages"][1]["error"]
    assert stock["user_config_after"] != original


def test_inference_stages_accept_a_config_without_optimizer_keys(stock_run, stagesafe_run):
    for stage in _stages(stagesafe_run, "stagesafe:config_inference"):
        _assert_clean(stage)
    assert "KeyError: 'zero_allow_untested_optimizer'" in _stages(stock_run, "stock:config_inference")[0]["error"]


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_stages_1_and_2(stock_run, stagesafe_run, zero_stage):
    stages = _stages(stagesafe_run, f"stagesafe:zero_stage_{zero_stage}")
    for stage in stages:
        _assert_clean(stage)
    stock = _stages(stock_run, f"stock:zero_stage_{zero_stage}")
    assert stock[0]["probe"]["dtypes"] == ["torch.bfloat16"]  # the engine cast the user's module in place


def test_default_handoff_lives_under_default_root_dir(stagesafe_run):
    case = stagesafe_run["rank0"]["stagesafe:default_handoff"]
    for stage in case["stages"]:
        _assert_clean(stage)
    uri = case["stages"][0]["boundary"]["uri"]
    assert uri.endswith("stagesafe_default_handoff/stagesafe_handoff")
    manifest = verify(uri)
    assert manifest["metadata"]["world_size"] == 2 and manifest["metadata"]["stage"] == "fit"  # test wrote nothing


def test_handoff_manifest_records_the_stage(stagesafe_run):
    case = stagesafe_run["rank0"]["stagesafe:demo"]
    manifest = read_manifest(case["handoff_uri"])
    meta = manifest["metadata"]
    assert meta["stage"] == "fit" and meta["world_size"] == 2 and meta["global_step"] == 4 and meta["epoch"] == 1
    assert set(meta["original_dtypes"].values()) == {"float32"}
    verify(case["handoff_uri"])


def test_a_module_left_stale_by_stock_deepspeed_is_refused(stagesafe_run):
    stock_fit, refused = _stages(stagesafe_run, "stagesafe:stale_module")
    assert stock_fit["probe"]["min_numel"] == 0
    assert refused["error"].startswith("StaleDeepSpeedStateError")
    assert "earlier DeepSpeed engine" in refused["error"] and "stagesafe.restore" in refused["error"]


def test_control_lightning_refuses_cpu(stock_run):
    (stage,) = _stages(stock_run, "lightning:cpu")
    assert "only supported on CUDA" in stage["error"]


def test_a_fit_that_raises_leaves_the_last_good_weights_and_the_next_stages_run(stagesafe_run):
    failed, test, fit_again = _stages(stagesafe_run, "stagesafe:raise_in_fit")
    assert "planned failure in training_step at step 2" in failed["error"]
    failed = {**failed, "error": None}
    for stage in (failed, test, fit_again):
        _assert_clean(stage)
    # two optimizer steps had completed: the module holds exactly what fit(max_steps=2) gives
    (two_steps,) = _stages(stagesafe_run, "stagesafe:two_steps")
    assert failed["probe"]["digest"] == two_steps["probe"]["digest"]
    assert test["probe"]["digest"] == failed["probe"]["digest"]
    assert fit_again["probe"]["digest"] != failed["probe"]["digest"]
    # the handoff says its weights are those of a fit that failed at its step 2, until a fit completes
    assert failed["handoff_digest"] == failed["probe"]["digest"]
    assert failed["handoff_from"] == {"stage": "fit", "global_step": 2, "call_failed": True}
    assert test["handoff_from"] == failed["handoff_from"]  # a test changes no weights: still the failed fit's
    assert fit_again["handoff_from"]["stage"] == "fit" and fit_again["handoff_from"]["call_failed"] is False


def test_a_failed_handoff_upload_is_raised_on_every_rank_and_nothing_is_lost(stagesafe_run):
    name = "stagesafe:publish_fails"
    first, failed, test = _stages(stagesafe_run, name)
    failed_on_1 = _stages(stagesafe_run, name, rank=1)[1]
    assert failed["error"].startswith("StorageTransferError: could not write shard")  # rank 0 could not write
    assert "File too large" in failed["error"] and "unchanged" in failed["error"]
    assert "failed on rank 0 (StorageTransferError" in failed_on_1["error"]  # rank 1 is told, instead of hanging
    assert failed["handoff_digest"] == first["probe"]["digest"]  # the previous handoff is intact
    failed = {**failed, "error": None}
    _assert_clean(failed)  # the module is clean and holds the new weights
    assert failed["probe"]["digest"] != first["probe"]["digest"]
    _assert_clean(test)
    assert test["handoff_digest"] == failed["probe"]["digest"]  # the next stage wrote the missing handoff


@pytest.mark.parametrize("name,failing_rank", [("background_write_fails", 0), ("share_fails_on_rank_1", 1)])
def test_a_failed_background_write_is_raised_by_the_next_call_on_every_rank_then_written_again(
    stagesafe_run, name, failing_rank
):
    name = f"stagesafe:{name}"
    for rank in (0, 1):
        first, failed, raised, again = _stages(stagesafe_run, name, rank)
        assert failed["error"] is None  # the call returned before its write failed
        _assert_clean(failed)
        # the next call raises the failure on every rank: the failing rank its own error, the others name it
        assert raised["error"] is not None and "File too large" in raised["error"], raised["error"]
        if rank != failing_rank:
            assert f"rank {failing_rank}" in raised["error"], raised["error"]
        assert raised["probe"]["digest"] == failed["probe"]["digest"]  # the module still holds the weights
        assert again["error"] is None
        _assert_clean(again)
    first, failed, raised, again = _stages(stagesafe_run, name)
    assert raised["handoff_digest"] == first["probe"]["digest"] != failed["probe"]["digest"]  # nothing committed
    assert again["handoff_digest"] == failed["probe"]["digest"] == again["probe"]["digest"]  # written again
    root = os.path.dirname(stagesafe_run["rank0"][name]["handoff_uri"])
    manifest = read_manifest(stagesafe_run["rank0"][name]["handoff_uri"])
    left = sorted(f for f in os.listdir(f"{root}/handoff") if f.startswith("model-") and f not in manifest["shards"])
    assert left == []  # the failed write's shards, every rank's, were deleted


def test_every_rank_writes_a_share_of_the_shards(stagesafe_run):
    first = _stages(stagesafe_run, "stagesafe:share_fails_on_rank_1")[0]
    on_rank_1 = _stages(stagesafe_run, "stagesafe:share_fails_on_rank_1", rank=1)[0]
    assert first["wrote_a_share"] and on_rank_1["wrote_a_share"]  # both ranks wrote shards of the first fit
    manifest = stagesafe.read_manifest(stagesafe_run["rank0"]["stagesafe:share_fails_on_rank_1"]["handoff_uri"])
    assert len(manifest["shards"]) > 2


def test_a_failed_streamed_write_in_meta_mode_keeps_the_weights_on_the_module(stagesafe_run):
    first, failed, test = _stages(stagesafe_run, "stagesafe:meta_write_fails")
    assert failed["error"].startswith("StorageTransferError: could not write shard")
    _assert_clean({**failed, "error": None})  # real fp32 tensors on the CPU, not meta ones: nothing lost
    assert failed["probe"]["digest"] != first["handoff_digest"]  # the new weights, which the handoff lacks
    assert failed["handoff_digest"] == first["handoff_digest"]  # the previous handoff is intact
    assert test["error"] is None and test["handoff_digest"] == failed["probe"]["digest"]  # written by the next stage


def test_a_background_write_is_a_private_copy_and_readers_see_only_what_is_committed(stagesafe_run):
    (rank0,) = _stages(stagesafe_run, "stagesafe:gated_write")
    (rank1,) = _stages(stagesafe_run, "stagesafe:gated_write", rank=1)
    for stage in (rank0, rank1):
        assert stage["still_writing"]  # fit returned while its handoff write was held at the gate
        assert stage["digest_after_change"] != stage["digest_when_fit_returned"]
    _assert_clean(rank0)
    assert rank0["read_while_writing"] == "HandoffNotFoundError"  # nothing committed yet: no half-written handoff
    # once joined, the handoff holds the weights fit returned, not the ones changed in place since
    assert rank0["read_after_join_digest"] == rank0["digest_when_fit_returned"]


def test_a_later_job_resumes_from_a_handoff(stagesafe_run):
    demo_final = _stages(stagesafe_run, "stagesafe:demo")[-1]["probe"]["digest"]
    test, fit = _stages(stagesafe_run, "stagesafe:resumed")
    _assert_clean(test)
    _assert_clean(fit)
    assert test["probe"]["digest"] == demo_final  # a fresh module took the handoff's weights
    assert fit["probe"]["digest"] != demo_final


@pytest.fixture(scope="module")
def single_rank_resume(stagesafe_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("seq-1rank")
    handoff = stagesafe_run["rank0"]["stagesafe:demo"]["handoff_uri"]
    spec = {
        "accelerator": "cpu", "devices": 1, "root": str(root),
        "cases": [{"name": "one_rank", "strategy": "stagesafe", "stages": ["test", "fit"], "resume_from": handoff,
                   "precision": "bf16-mixed"}],
    }
    (root / "spec.json").write_text(json.dumps(spec))
    run_script(SCRIPT, [str(root / "spec.json"), str(root / "out")], timeout=240, cwd=str(root))
    return json.loads((root / "out.rank0.json").read_text())


def test_a_handoff_written_by_two_ranks_resumes_a_one_rank_job(stagesafe_run, single_rank_resume):
    demo_final = _stages(stagesafe_run, "stagesafe:demo")[-1]["probe"]["digest"]
    test, fit = single_rank_resume["one_rank"]["stages"]
    _assert_clean(test)
    _assert_clean(fit)
    assert test["probe"]["digest"] == demo_final
    assert read_manifest(single_rank_resume["one_rank"]["handoff_uri"])["metadata"]["world_size"] == 1


def test_cli_consolidates_a_checkpoint_written_by_lightning(stagesafe_run, tmp_path, capsys):
    """ModelCheckpoint under the strategy writes DeepSpeed's sharded folder; `stagesafe consolidate` turns it
    into the handoff format, equal to DeepSpeed's own reader and to the weights the module ended with."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from stagesafe.cli import main
    from toy import state_digest_of

    last = stagesafe_run["root"] / "stagesafe_ckpt" / "ckpt" / "last.ckpt"
    assert (last / "latest").is_file()
    assert main(["consolidate", str(last), str(tmp_path / "out"), "-q"]) == 0
    ours = load_state_dict(str(tmp_path / "out"))
    reference = get_fp32_state_dict_from_zero_checkpoint(str(last))
    assert set(reference) <= set(ours)
    for name, tensor in reference.items():
        assert torch.equal(ours[name].view(torch.int32), tensor.view(torch.int32)), name
    resumed_fit = _stages(stagesafe_run, "stagesafe:ckpt")[-1]["probe"]["digest"]
    assert state_digest_of(ours) == resumed_fit


def test_zero3_offload_gives_the_same_weights_as_without(stagesafe_run):
    offload = _stages(stagesafe_run, "stagesafe:offload")
    plain = _stages(stagesafe_run, "stagesafe:zero_stage_1")  # same stages; every ZeRO stage gives the same bits
    for stage in offload:
        _assert_clean(stage)
    assert [s["probe"]["digest"] for s in offload] == [s["probe"]["digest"] for s in plain]


def _handoffs(run: dict, name: str) -> list[str]:
    return [s["handoff_digest"] for s in _stages(run, name)]


def test_meta_mode_holds_no_weights_between_stages_and_gives_the_cpu_modes_bits(stagesafe_run):
    for rank in (0, 1):
        for stage in _stages(stagesafe_run, "stagesafe:meta", rank):
            assert stage["error"] is None, stage.get("traceback")
            assert stage["probe"]["devices"] == ["meta"]  # no parameter storage between stages
            assert stage["probe"]["ds_attrs"] == 0 and stage["probe"]["deepspeed_hooks"] == 0
    cpu_mode = [s["probe"]["digest"] for s in _stages(stagesafe_run, "stagesafe:zero_stage_1")]  # fit, test, fit
    assert _handoffs(stagesafe_run, "stagesafe:meta") == cpu_mode
    assert _handoffs(stagesafe_run, "stagesafe:meta_frozen") == [s["probe"]["digest"] for s in _stages(stagesafe_run, "stagesafe:frozen")]
    # stagesafe.restore materialises the module on demand
    module = restore(ToyModule(), stagesafe_run["rank0"]["stagesafe:meta"]["handoff_uri"])
    assert state_digest(module) == cpu_mode[-1]


def test_meta_mode_resumes_a_module_built_on_the_meta_device(stagesafe_run):
    stages = _stages(stagesafe_run, "stagesafe:meta_resumed")
    for stage in stages:
        assert stage["error"] is None, stage.get("traceback")
        assert stage["probe"]["devices"] == ["meta"]
    cpu_mode = [s["probe"]["digest"] for s in _stages(stagesafe_run, "stagesafe:resumed")]  # the same, in cpu mode
    assert stages[-1]["handoff_digest"] == cpu_mode[-1]
