"""The optimizer state beside a handoff (stagesafe.handoff.optimizer_state), written by ``consolidate --optimizer``
(stagesafe.consolidate_optimizer) and read per parameter (stagesafe.zero.handoff_optimizer), without an engine.

Checkpoints in DeepSpeed's layout written here (tests/_hostile.py) whose moments say where they came from:
exp_avg = 2 x and exp_avg_sq = 3 x the fp32 master, step 5 (tests/test_checkpoint_optimizer.py). Resuming an
engine from it at another world size is tests/test_world_size.py's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from _hostile import run_python, write_zero_checkpoint
from test_checkpoint_optimizer import PARAMS, _with_state
from stagesafe import load_state_dict, read_manifest, save_state_dict
from stagesafe.cli import main
from stagesafe.consolidate import consolidate
from stagesafe.errors import CheckpointFormatError, HandoffCorruptError, InvalidArgumentError, StorageTransferError
from stagesafe.handoff.optimizer_state import FORM, binding, bound_folder, forget_unbound, new_folder, open_form
from stagesafe.publishing.verify import verify
from stagesafe.storage.fs import resolve
from stagesafe.zero.handoff_optimizer import HandoffOptimizer


def _state(dst: str) -> str:
    """The optimizer state's folder that the handoff at ``dst`` names."""
    return f"{dst}/{bound_folder(read_manifest(dst))}"


def _checkpoint(tmp_path, stage: int = 3, world_size: int = 2, **kwargs) -> str:
    return write_zero_checkpoint(str(tmp_path / "ckpt"), PARAMS, stage=stage, world_size=world_size,
                                 edit=_with_state(stage, **kwargs))


@pytest.mark.parametrize(("stage", "world_size"), [(3, 2), (3, 3), (2, 3), (1, 2)])
def test_each_parameters_moments_are_written_under_its_name_with_the_step_and_hyperparameters(
    tmp_path, stage, world_size
):
    dst = str(tmp_path / "out")
    manifest = consolidate(_checkpoint(tmp_path, stage, world_size), dst, optimizer=True, max_shard_size=700)
    weights, state = load_state_dict(dst), load_state_dict(_state(dst))
    assert set(state) == {f"{key}/{name}" for key in ("exp_avg", "exp_avg_sq") for name in PARAMS}
    for name, value in PARAMS.items():
        assert torch.equal(weights[name], value)
        assert torch.equal(state[f"exp_avg/{name}"], value * 2) and torch.equal(state[f"exp_avg_sq/{name}"], value * 3)
    form = open_form(dst)
    folder = manifest["metadata"]["optimizer"]["folder"]
    assert manifest["metadata"]["optimizer"] == binding(folder, form.manifest) and len(form.manifest["shards"]) > 1
    assert form.url == f"{dst}/{folder}" and os.listdir(dst).count(folder) == 1
    assert form.keys == ("exp_avg", "exp_avg_sq") and len(form.groups) == 1
    group = form.groups[0]
    assert group.params == tuple(PARAMS) and group.state == {"step": {"dtype": "float32", "value": 5.0}}
    assert group.hyperparameters == {"lr": 0.1, "betas": [0.9, 0.99], "weight_decay": 0.1}
    assert form.source["world_size"] == world_size and form.source["zero_stage"] == stage


def test_the_command_writes_it_without_torch_and_verify_checks_both(tmp_path):
    src, dst = _checkpoint(tmp_path), str(tmp_path / "out")
    code = ("import sys; from stagesafe.cli import main; rc = main(['consolidate', '--optimizer', *sys.argv[1:]]); "
            "rc = rc or main(['verify', sys.argv[2]]); print('TORCH', 'torch' in sys.modules); sys.exit(rc)")
    result = run_python(code, src, dst)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TORCH False" in result.stdout and f"optimizer state to {_state(dst)} " in result.stdout
    assert "and the optimizer state beside it" in result.stdout


def test_a_changed_byte_of_the_state_fails_verify(tmp_path, capsys):
    dst = str(tmp_path / "out")
    consolidate(_checkpoint(tmp_path), dst, optimizer=True)
    (shard,) = read_manifest(_state(dst))["shards"]
    path = os.path.join(_state(dst), shard)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 3)
        f.write(b"\x7f")
    assert main(["verify", dst]) == 1
    assert "optimizer" in capsys.readouterr().err
    with pytest.raises(HandoffCorruptError, match="its bytes were changed"):
        verify(dst)


def test_a_state_the_weights_were_not_written_with_is_refused(tmp_path):
    """Another write's state in the folder (here: another checkpoint's, written over it alone) is never taken
    for the one the weights name."""
    dst = str(tmp_path / "out")
    consolidate(_checkpoint(tmp_path), dst, optimizer=True)
    other = str(tmp_path / "other")
    consolidate(_checkpoint(tmp_path / "b", 2, 3), other, optimizer=True)
    save_state_dict(load_state_dict(_state(other)), _state(dst), overwrite=True,
                    metadata=read_manifest(_state(other))["metadata"])
    with pytest.raises(HandoffCorruptError, match="not the one these weights were written with"):
        open_form(dst)
    with pytest.raises(HandoffCorruptError, match="not the one these weights were written with"):
        verify(dst)


def test_the_state_is_read_per_parameter_by_any_slice(tmp_path):
    dst = str(tmp_path / "out")
    consolidate(_checkpoint(tmp_path, 2, 3), dst, optimizer=True, max_shard_size=700)
    source = HandoffOptimizer(open_form(dst), dst)
    assert source.specs["body.bias"] == ("param", (7,)) and source.param_group_of("embed.weight") == 0
    assert source.values(0) == {"step": torch.tensor(5.0)} and source.values(0)["step"].dtype == torch.float32
    reads, expected = [], []
    for name, value in PARAMS.items():
        flat = value.reshape(-1)
        for key, factor in ((None, 1), ("exp_avg", 2), ("exp_avg_sq", 3)):
            for first, count in ((0, 3), (4, flat.numel() - 4)):
                out = torch.full((count,), float("nan"))
                reads.append((name, key, first, out))
                expected.append(flat[first : first + count] * factor)
    source.read_all(reads)
    for (name, key, _, out), want in zip(reads, expected):
        assert torch.equal(out, want), (name, key)


def test_state_that_is_not_per_parameter_is_refused_before_anything_is_written(tmp_path, capsys):
    def preconditioner(rank, flat):
        return {"step": torch.tensor(1.0), "exp_avg": flat.clone(), "preconditioner": torch.eye(3)}

    dst = str(tmp_path / "out")
    assert main(["consolidate", "--optimizer", _checkpoint(tmp_path, state=preconditioner), dst]) == 2
    assert "'preconditioner' is a tensor of shape [3, 3]" in capsys.readouterr().err
    assert not os.path.exists(dst)
    with pytest.raises(CheckpointFormatError, match="cannot be re-partitioned"):
        consolidate(_checkpoint(tmp_path / "b", state=preconditioner), dst, optimizer=True)


def test_the_state_needs_fp32_weights(tmp_path, capsys):
    dst = str(tmp_path / "out")
    assert main(["consolidate", "--optimizer", "--dtype", "bf16", _checkpoint(tmp_path), dst]) == 2
    assert "fp32 master weights, which a cast would lose" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="dtype='bfloat16'"):
        consolidate(_checkpoint(tmp_path / "b"), dst, optimizer=True, dtype="bf16")
    assert not os.path.exists(dst)


def test_weights_only_has_no_state_and_an_unknown_form_is_refused(tmp_path):
    dst = str(tmp_path / "out")
    consolidate(_checkpoint(tmp_path), dst)
    assert open_form(dst) is None
    weights = load_state_dict(dst)
    save_state_dict(weights, dst, overwrite=True, metadata={"optimizer": {"format": "stagesafe-optimizer/9"}})
    with pytest.raises(HandoffCorruptError, match=f"not a form this stagesafe reads \\({FORM}, in a folder"):
        open_form(dst)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda body: body["param_groups"][0]["params"].pop(), "which no param group names"),
        (lambda body: body["param_groups"].append({"params": ["body.bias"], "hyperparameters": {}, "state": {}}),
         "are in two param groups"),
        (lambda body: body.update(keys=["exp_avg", "momentum_buffer"]), "'momentum_buffer/body.bias' is None"),
        (lambda body: body["param_groups"][0]["state"].update(step=5), "state 'step' is 5"),
    ],
)
def test_a_form_whose_json_disagrees_with_its_tensors_is_refused(tmp_path, edit, says):
    """A state written by hand (or edited) is checked against its tensors and the weights beside it."""
    dst = str(tmp_path / "out")
    consolidate(_checkpoint(tmp_path), dst, optimizer=True)
    folder = _state(dst)
    metadata = json.loads(json.dumps(read_manifest(folder)["metadata"]))
    edit(metadata["optimizer_state"])
    rewritten = save_state_dict(load_state_dict(folder), folder, overwrite=True, metadata=metadata)
    weights = read_manifest(dst)
    save_state_dict(load_state_dict(dst), dst, overwrite=True,
                    metadata={**weights["metadata"], "optimizer": binding(os.path.basename(folder), rewritten)})
    with pytest.raises(HandoffCorruptError, match=says):
        open_form(dst)


def test_on_s3(s3, tmp_path):
    """The form on an object store: written by the command, verified, read per parameter."""
    url, options = s3.new_url(), s3.storage_options()
    consolidate(_checkpoint(tmp_path), url, optimizer=True, storage_options=options)
    assert {n.split("/")[0] for n in s3.objects(url)} == {bound_folder(read_manifest(url, storage_options=options)),
                                                          "stagesafe.json", "model.safetensors.index.json",
                                                          *read_manifest(url, storage_options=options)["shards"]}
    verify(url, storage_options=options)
    source = HandoffOptimizer(open_form(url, storage_options=options), url, storage_options=options)
    out = torch.empty(7)
    source.read_all([("body.bias", "exp_avg_sq", 0, out)])
    assert torch.equal(out, PARAMS["body.bias"] * 3)


def test_a_new_write_replaces_the_pair_and_the_old_state_goes_after_the_commit(tmp_path):
    """--overwrite writes the new state beside the old pair, which stays whole until the new weights commit;
    then the old state, which nothing names any more, goes."""
    dst = str(tmp_path / "out")
    consolidate(_checkpoint(tmp_path), dst, optimizer=True)
    first = bound_folder(read_manifest(dst))
    consolidate(_checkpoint(tmp_path / "b", 2, 3), dst, optimizer=True, overwrite=True)
    second = bound_folder(read_manifest(dst))
    assert second != first and sorted(d for d in os.listdir(dst) if d.startswith("optimizer")) == [second]
    assert open_form(dst).source["world_size"] == 3
    consolidate(_checkpoint(tmp_path / "c"), dst, overwrite=True)  # weights only: the state goes too
    assert open_form(dst) is None and not any(d.startswith("optimizer") for d in os.listdir(dst))


def test_weights_that_fail_to_commit_leave_no_state(s3, tmp_path):
    """The state is committed, then the weights' commit fails (the S3 server refuses that one PUT): the state,
    which no weights name, goes too, and the folder holds nothing."""
    url, options = s3.new_url(), s3.storage_options()
    s3.fail("PUT", r"[0-9a-f]{32}/handoff/stagesafe\.json$", 403, "AccessDenied")  # the weights' manifest only
    with pytest.raises(StorageTransferError, match="could not commit .*access denied"):
        consolidate(_checkpoint(tmp_path), url, optimizer=True, storage_options=options)
    assert s3.objects(url) == {}


def test_weights_whose_commit_fails_on_a_local_disk_leave_no_state(tmp_path):
    """The state committed, the weights' commit fails (a folder where their manifest goes): the state goes, and
    the weights' shards; what was there stays."""
    dst = tmp_path / "out"
    (dst / "stagesafe.json").mkdir(parents=True)
    (dst / "stagesafe.json" / "x").write_text("x")
    with pytest.raises(Exception, match="stagesafe.json"):
        consolidate(_checkpoint(tmp_path), str(dst), optimizer=True, overwrite=True)
    assert sorted(os.listdir(dst)) == ["stagesafe.json"]


def test_a_new_state_folder_is_none_of_the_folders_there(tmp_path, monkeypatch):
    (tmp_path / "optimizer-00000000").mkdir()
    tokens = iter(["00000000", "0000000a"])
    monkeypatch.setattr("secrets.token_hex", lambda n: next(tokens))
    assert new_folder(*resolve(str(tmp_path), None)) == "optimizer-0000000a"


def test_a_state_that_the_committed_weights_name_stays_and_one_they_do_not_name_goes(tmp_path):
    dst = str(tmp_path / "out")
    consolidate(_checkpoint(tmp_path), dst, optimizer=True)
    bound = bound_folder(read_manifest(dst))
    fs, root = resolve(dst, None)
    forget_unbound(fs, root, bound)  # the weights name it: a failed later write must not take it away
    assert open_form(dst) is not None
    save_state_dict({"w": torch.ones(2)}, f"{dst}/optimizer-0000000b")  # a state whose weights never committed
    forget_unbound(fs, root, "optimizer-0000000b")
    assert not os.path.exists(f"{dst}/optimizer-0000000b") and open_form(dst) is not None
