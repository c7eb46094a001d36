"""The safe loader of DeepSpeed's pickled files: allow-list, refusal without execution, memory mapping."""

from __future__ import annotations

import copyreg
import os
import subprocess
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch

from stagesafe.zero.safe_pickle import ALLOWED_GLOBALS, OpaqueRecord, can_map, safe_load
from stagesafe.errors import CheckpointFormatError, StageSafeError, UnsafeCheckpointError

pytestmark = pytest.mark.timeout(60)


class _System:
    """Pickles as a call of os.system: the classic payload."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _Eval:
    def __reduce__(self):
        return (eval, ("__import__('os').system('true')",))


class _UserConfig:
    """An ordinary class of a user's project: not on the allow-list either."""

    def __init__(self):
        self.lr = 0.1


def test_plain_tensors_and_containers(tmp_path):
    path = tmp_path / "plain.pt"
    obj = {"w": torch.arange(6.0).view(2, 3), "od": OrderedDict(a=1), "shape": torch.Size([2, 3]), "s": {1, 2}}
    torch.save(obj, path)
    loaded = safe_load(str(path))
    assert torch.equal(loaded["w"], obj["w"])
    assert loaded["od"] == obj["od"] and loaded["shape"] == obj["shape"] and loaded["s"] == {1, 2}


def test_deepspeed_globals_load_as_inert_stand_ins(tmp_path):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    path = tmp_path / "optim.pt"
    torch.save(
        {
            "optimizer_state_dict": {
                "loss_scaler": loss_scaler.LossScaler(scale=4.0),
                "dynamic": loss_scaler.DynamicLossScaler(8.0, 1000, 1.0, 2, False),
                "zero_stage": ZeroStageEnum.weights,
                "param_slice_mappings": [OrderedDict(w=fragment_address(numel=5, start=3))],
            }
        },
        path,
    )
    osd = safe_load(str(path))["optimizer_state_dict"]
    assert osd["zero_stage"] == 3 and type(osd["zero_stage"]) is int
    assert isinstance(osd["loss_scaler"], OpaqueRecord) and osd["loss_scaler"].cur_scale == 4.0
    assert "LossScaler (not imported)" in repr(osd["loss_scaler"])
    assert isinstance(osd["dynamic"], OpaqueRecord) and osd["dynamic"].cur_scale == 8.0
    address = osd["param_slice_mappings"][0]["w"]
    assert (address.numel, address.start) == (5, 3)


def test_lightning_attribute_dict_loads_as_dict(tmp_path):
    data = pytest.importorskip("lightning.fabric.utilities.data")
    path = tmp_path / "client.pt"
    torch.save({"hyper_parameters": data.AttributeDict(lr=0.1, layers=[1, 2])}, path)
    hp = safe_load(str(path))["hyper_parameters"]
    assert type(hp) is dict and hp == {"lr": 0.1, "layers": [1, 2]}


@pytest.mark.slow
def test_loading_imports_nothing_it_names(tmp_path):
    """The stand-ins are used by name: loading a DeepSpeed file must not import deepspeed (or run its code)."""
    pytest.importorskip("deepspeed")
    path = tmp_path / "optim.pt"
    script = textwrap.dedent(
        f"""
        import sys, torch
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        torch.save({{"loss_scaler": LossScaler(scale=2.0)}}, {str(path)!r})
        """
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, capture_output=True, timeout=60)
    check = textwrap.dedent(
        f"""
        import sys
        from stagesafe.zero.safe_pickle import safe_load
        obj = safe_load({str(path)!r})
        assert obj["loss_scaler"].cur_scale == 2.0
        assert "deepspeed" not in sys.modules, "safe_load imported deepspeed"
        """
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", check],
        env={**env, "PYTHONPATH": repo},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    "payload,refused",
    [(lambda marker: _System(f"touch {marker}"), "system"), (lambda marker: _Eval(), "eval")],
    ids=["os.system", "eval"],
)
def test_code_in_a_pickle_is_refused_not_run(tmp_path, payload, refused):
    marker = tmp_path / "pwned"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    # nested where a real file keeps data, beside real tensors
    torch.save({"optimizer_state_dict": {"fp32_flat_groups": [torch.ones(3)], "x": payload(marker)}}, path)
    with pytest.raises(UnsafeCheckpointError) as info:
        safe_load(str(path))
    message = str(info.value)
    assert str(path) in message and refused in message
    assert "nothing from the file was executed" in message
    assert not marker.exists()
    assert isinstance(info.value, StageSafeError) and isinstance(info.value, ValueError)


def test_unknown_class_is_refused_by_name(tmp_path):
    path = tmp_path / "model_states.pt"
    torch.save({"hyper_parameters": _UserConfig()}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"the global '[\w.]*_UserConfig'"):
        safe_load(str(path), display_name="ckpt/model_states.pt")


def test_extra_globals_are_honoured_only_for_that_call(tmp_path):
    path = tmp_path / "model_states.pt"
    torch.save({"cfg": _UserConfig()}, path)
    name = f"{_UserConfig.__module__}.{_UserConfig.__qualname__}"
    stand_in = type("UserConfig", (OpaqueRecord,), {})
    assert safe_load(str(path), extra_globals=[(stand_in, name)])["cfg"].lr == 0.1
    with pytest.raises(UnsafeCheckpointError):
        safe_load(str(path))  # the allow-list did not grow


def test_file_object_and_legacy_format_are_read_without_mmap(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(4)}, path, _use_new_zipfile_serialization=False)
    assert not can_map(str(path))
    assert torch.equal(safe_load(str(path))["w"], torch.ones(4))
    with open(path, "rb") as f:
        assert not can_map(f)
        assert torch.equal(safe_load(f)["w"], torch.ones(4))
    zipped = tmp_path / "zip.pt"
    torch.save({"w": torch.ones(4)}, zipped)
    assert can_map(str(zipped)) and can_map(zipped)


def test_allow_list_is_short_and_names_no_callables_of_os():
    assert len(ALLOWED_GLOBALS) <= 10
    assert not any(
        name.split(".")[0] in {"os", "posix", "nt", "subprocess", "builtins", "sys"} for name in ALLOWED_GLOBALS
    )


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_damaged_file_is_a_format_error_naming_it(tmp_path, how):
    path = tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"w": torch.ones(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(CheckpointFormatError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt cannot be read"):
        safe_load(str(path))
    with pytest.raises(FileNotFoundError):
        safe_load(str(tmp_path / "missing.pt"))


class _Calls:
    """Pickles as a call of ``func(*args)``: an allow-listed global given arguments of an attacker's choice;
    with ``state``, as an instance of ``args[0]`` built from that state."""

    def __init__(self, func, *args, state=None):
        self.reduced = (func, args) if state is None else (func, args, state)

    @property
    def __class__(self):  # what pickle checks NEWOBJ's class against
        return self.reduced[1][0] if len(self.reduced) == 3 else _Calls

    def __reduce_ex__(self, protocol):
        return self.reduced


def _allowed_globals_misused():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from lightning.fabric.utilities.data import AttributeDict

    return {
        "ZeroStageEnum('x')": _Calls(ZeroStageEnum, "x"),
        "ZeroStageEnum([])": _Calls(ZeroStageEnum, []),
        "AttributeDict(3)": _Calls(AttributeDict, 3),
        "LossScaler with a list as its state": _Calls(copyreg.__newobj__, LossScaler, state=[1, 2]),
    }


@pytest.mark.parametrize("case", range(4))
def test_allowed_classes_given_arguments_they_refuse_are_a_format_error(tmp_path, case):
    name, payload = list(_allowed_globals_misused().items())[case]
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": payload}}, path)
    for meta in (False, True):
        with pytest.raises(CheckpointFormatError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt cannot be read"):
            safe_load(str(path), meta=meta)
