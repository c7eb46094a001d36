"""ZeRO checkpoint folders written without an engine (stagesafe/zero/checkpoint_writer.py): the weights-only folder
of ``write_zero_checkpoint`` is read back bit for bit by DeepSpeed's own ``zero_to_fp32`` and by stagesafe's reader,
for every ZeRO stage, with trained, frozen and tied parameters, buffers and the client state; and the files of a
kept engine state written where DeepSpeed writes them (``write_engine_checkpoint``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat

import pytest
import torch
from _tensors import assert_bitwise_equal
from torch import nn

from stagesafe.errors import InvalidArgumentError
from stagesafe.zero.checkpoint import open_zero_checkpoint
from stagesafe.zero.checkpoint_writer import (
    RECOVERY_SCRIPTS,
    WEIGHTS_ONLY_MARKER,
    holds_optimizer_state,
    is_weights_only,
    write_engine_checkpoint,
    write_zero_checkpoint,
)

pytestmark = pytest.mark.timeout(60)

FROZEN = ["frozen.weight", "frozen.bias"]
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.hidden = nn.Linear(4, 5)
        self.frozen = nn.Linear(5, 3)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([1.5, -0.0]))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)  # not in the state dict: not written
        self.to(dtype)


def _net(dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(0)
    return Net(dtype)


def _expected(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as DeepSpeed's reader gives it: trained parameters as their fp32 masters, the rest as they
    are; tied names included, sorted by name."""
    state = model.state_dict()
    trained = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {name: (t.float() if name in trained else t) for name, t in sorted(state.items())}


def _deepspeed_reads(path: str, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    zero_to_fp32 = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(path, None, exclude_frozen)
    return dict(sorted(state.items()))


def _stagesafe_reads(path: str) -> dict[str, torch.Tensor]:
    with open_zero_checkpoint(path) as ckpt:
        return dict(sorted(ckpt.load_state_dict().items()))


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_a_weights_only_folder_is_read_by_deepspeed_and_by_stagesafe_bitwise(tmp_path, zero_stage):
    model = _net()
    path = str(tmp_path / "ckpt")
    write_zero_checkpoint(path, model, zero_stage=zero_stage, client_state={"epoch": 3, "note": "mine"})
    expected = _expected(model)
    assert_bitwise_equal(_deepspeed_reads(path), expected)
    assert_bitwise_equal(_stagesafe_reads(path), expected)
    with open_zero_checkpoint(path) as ckpt:
        assert (ckpt.stage, ckpt.world_size, ckpt.tag, ckpt.layout) == (zero_stage, 1, "checkpoint", "lightning")
        assert ckpt.client_state == {"epoch": 3, "note": "mine"}
        assert ckpt.aliases == {"head.weight": "embed.weight"}
        assert [name for name, spec in ckpt.tensors.items() if spec.kind == "frozen"] == FROZEN
    optim = torch.load(os.path.join(path, "checkpoint", OPTIM_FILE), weights_only=False)["optimizer_state_dict"]
    flat = optim["fp32_flat_groups" if zero_stage == 3 else "single_partition_of_fp32_groups"][0]
    trained = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])
    padding = trained.new_zeros(trained.numel() % 2 if zero_stage < 3 else 0)  # stages 1, 2: to 2 x world size
    assert_bitwise_equal({"flat": flat}, {"flat": torch.cat([trained, padding])})


def test_the_folder_says_it_holds_weights_only(tmp_path):
    path = str(tmp_path / "ckpt")
    assert not is_weights_only(path)
    write_zero_checkpoint(path, _net(), zero_stage=3, client_state={}, tag="mine")
    assert is_weights_only(path)
    with open(os.path.join(path, WEIGHTS_ONLY_MARKER)) as f:
        assert json.load(f) == {"written_by": "stagesafe", "weights_only": True, "zero_stage": 3, "tag": "mine"}
    with open(os.path.join(path, "latest")) as f:
        assert f.read() == "mine"
    assert sorted(os.listdir(os.path.join(path, "mine"))) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        OPTIM_FILE,
    ]
    assert sorted(os.listdir(path)) == sorted(["latest", "mine", WEIGHTS_ONLY_MARKER, *RECOVERY_SCRIPTS])
    _assert_deepspeeds_scripts_are_there(path)


def _assert_deepspeeds_scripts_are_there(path: str) -> None:
    """DeepSpeed's engine copies its recovery scripts into the folder it saves, executable: so does stagesafe."""
    import deepspeed

    for script in RECOVERY_SCRIPTS:
        copied = os.path.join(path, script)
        shipped = os.path.join(os.path.dirname(deepspeed.__file__), "utils", script)
        with open(copied, "rb") as mine, open(shipped, "rb") as theirs:
            assert mine.read() == theirs.read(), script
        assert os.stat(copied).st_mode & stat.S_IXUSR, script


@pytest.mark.parametrize("bf16", [True, False])
def test_a_full_save_over_a_weights_only_one_leaves_one_runs_optimizer_files(tmp_path, bf16):
    """DeepSpeed saving into a weights-only folder names its optimizer files bf16_... under bf16, beside the
    weights-only save's: that one goes with the marker, so the folder reads as one run's (stagesafe's reader
    refuses two kinds); without bf16 DeepSpeed wrote over it, and it stays."""
    path = str(tmp_path / "ckpt")
    write_zero_checkpoint(path, _net(), zero_stage=3, client_state={})
    folder = os.path.join(path, "checkpoint")
    deepspeeds = f"bf16_{OPTIM_FILE}" if bf16 else OPTIM_FILE
    with open(os.path.join(folder, deepspeeds), "ab"):
        pass
    holds_optimizer_state(path)
    assert not is_weights_only(path)
    assert sorted(n for n in os.listdir(folder) if "optim" in n) == [deepspeeds]


def test_16_bit_weights_are_written_as_fp32_masters_and_the_rest_in_their_own_dtype(tmp_path):
    model = _net(torch.bfloat16)
    path = str(tmp_path / "ckpt")
    write_zero_checkpoint(path, model, zero_stage=2, client_state={})
    expected = _expected(model)
    assert expected["hidden.weight"].dtype == torch.float32 and expected["frozen.weight"].dtype == torch.bfloat16
    expected["scale"] = expected["scale"].float()  # both readers give floating buffers as fp32
    assert_bitwise_equal(_deepspeed_reads(path), expected)
    assert_bitwise_equal(_stagesafe_reads(path), expected)


def test_values_stand_in_for_a_module_of_meta_tensors(tmp_path):
    real = _net()
    with torch.device("meta"):
        meta = Net()
    write_zero_checkpoint(str(tmp_path / "real"), real, zero_stage=3, client_state={})
    write_zero_checkpoint(str(tmp_path / "meta"), meta, values=real.state_dict(), zero_stage=3, client_state={})
    assert_bitwise_equal(_stagesafe_reads(str(tmp_path / "meta")), _stagesafe_reads(str(tmp_path / "real")))


def test_exclude_frozen_leaves_the_frozen_parameters_out(tmp_path):
    model = _net()
    path = str(tmp_path / "ckpt")
    write_zero_checkpoint(path, model, zero_stage=3, client_state={}, exclude_frozen=True)
    expected = {name: t for name, t in _expected(model).items() if name not in FROZEN}
    assert_bitwise_equal(_stagesafe_reads(path), expected)
    assert_bitwise_equal(_deepspeed_reads(path, exclude_frozen=True), expected)


@pytest.mark.parametrize("zero_stage", [0, 4, "3"])
def test_a_stage_that_is_not_zeros_is_refused_before_anything_is_written(tmp_path, zero_stage):
    with pytest.raises(InvalidArgumentError, match=f"zero_stage={zero_stage!r}: .* stage 1, 2 or 3"):
        write_zero_checkpoint(str(tmp_path / "ckpt"), _net(), zero_stage=zero_stage, client_state={})
    assert not (tmp_path / "ckpt").exists()


# -- a kept engine state's files -------------------------------------------------------------------------------------


def test_the_kept_files_are_written_as_deepspeed_names_them_with_the_client_state(tmp_path):
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    open(os.path.join(path, WEIGHTS_ONLY_MARKER), "w").close()  # an earlier weights-only save into the folder
    files = {
        "zero_pp_rank_0_mp_rank_00_model_states.pt": {"module": {}, "global_steps": 4},
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": {"optimizer_state_dict": {"x": torch.ones(2)}},
    }
    client = {"epoch": 1, "lr_schedulers": [{"last_epoch": 4}]}
    write_engine_checkpoint(path, files, client_state=client, latest=True)
    folder = os.path.join(path, "checkpoint")
    assert sorted(os.listdir(folder)) == sorted(files)  # no temporary file left
    model = torch.load(os.path.join(folder, "zero_pp_rank_0_mp_rank_00_model_states.pt"), weights_only=False)
    assert model == {"module": {}, "global_steps": 4, **client}
    optim = torch.load(os.path.join(folder, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"), weights_only=False)
    assert set(optim) == {"optimizer_state_dict"}  # the client state goes to model states only, as DeepSpeed does
    assert open(os.path.join(path, "latest")).read() == "checkpoint"
    assert not is_weights_only(path)
    _assert_deepspeeds_scripts_are_there(path)


def test_ranks_without_latest_write_only_their_files(tmp_path):
    path = str(tmp_path / "ckpt")
    write_engine_checkpoint(path, {"zero_pp_rank_1_mp_rank_00_model_states.pt": {}}, client_state={}, latest=False)
    assert os.listdir(path) == ["checkpoint"]  # rank 0 writes latest and the scripts
