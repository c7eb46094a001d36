"""The reader of DeepSpeed's pickles (stagesafe/zero/pickle_reader.py, pickle_globals.py): what it builds, what it
refuses, and that nothing a pickle names is ever imported or run."""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import zipfile
from collections import OrderedDict

import pytest
import torch
from _hostile import run_python, torch_save_pickle

from stagesafe.errors import CheckpointFormatError, StageSafeError, UnsafeCheckpointError
from stagesafe.zero.pickle_globals import ALLOWED_GLOBALS, OpaqueRecord, TensorRecord, TorchDType, TorchDevice, TorchSize
from stagesafe.zero.pickle_reader import read_pickle

pytestmark = pytest.mark.timeout(60)


def read(data: bytes):
    return read_pickle(data, display="ckpt/zero_pp_rank_0_mp_rank_00_optim_states.pt")


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


# -- what it builds ------------------------------------------------------------------------------------------------


def test_tensors_are_records_of_where_their_bytes_are():
    base = torch.arange(24.0).view(4, 6)
    obj = {
        "w": base,
        "view": base[1:, ::2],  # an offset and strides, sharing w's storage
        "b16": torch.ones(3, dtype=torch.bfloat16),
        "u16": torch.ones(2, dtype=torch.uint16),  # a dtype torch.save writes with _rebuild_tensor_v3
        "p": torch.nn.Parameter(torch.ones(2)),
        "empty": torch.empty(0, 5),
    }
    records = read(torch_save_pickle(obj))
    for name, tensor in obj.items():
        record = records[name]
        assert isinstance(record, TensorRecord)
        assert record.dtype == str(tensor.dtype).removeprefix("torch.")
        assert (record.shape, record.stride, record.offset) == (tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
        assert record.storage.nbytes == tensor.untyped_storage().nbytes()
        assert record.is_contiguous() == tensor.is_contiguous()
    assert records["w"].storage is records["view"].storage
    assert records["p"].parameter and records["p"].requires_grad


def test_plain_values_are_what_pickle_gives():
    """Whatever protocol, plain data reads as Python's own unpickler reads it, sharing and cycles included."""
    shared = [1, 2]
    cyclic: list = ["x"]
    cyclic.append(cyclic)
    obj = {
        "od": OrderedDict(a=1, b=[None, True, False]),
        "numbers": (0, -1, 255, 65535, 2**31, -(2**63), 2**100, 1.5, -0.0, float("inf")),
        "text": ["", "é", "a\ud800", "x" * 300],
        "bytes": [b"", b"\x00\xff", bytearray(b"ab"), bytearray()],
        "sets": ({1, "a", (1, 2)}, frozenset({None, 2.5})),
        "shared": [shared, shared],
        "cyclic": cyclic,
        3: {(1, "k"): "tuple key"},
    }
    for protocol in (2, 3, 4, 5):
        data = pickle.dumps(obj, protocol=protocol)
        ours = read(data)
        assert repr(ours) == repr(pickle.loads(data)), protocol
        assert ours["shared"][0] is ours["shared"][1] and ours["cyclic"][1] is ours["cyclic"]


def test_torch_values_are_inert_stand_ins():
    obj = {"size": torch.Size([2, 3]), "dtype": torch.bfloat16, "gpu": torch.device("cuda", 1), "cpu": torch.device("cpu")}
    values = read(torch_save_pickle(obj))
    assert values["size"] == (2, 3) and type(values["size"]) is TorchSize
    assert values["dtype"] == TorchDType("bfloat16")
    assert values["gpu"] == TorchDevice("cuda", 1) and values["cpu"] == TorchDevice("cpu")


def test_deepspeed_globals_load_as_inert_stand_ins():
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    osd = read(
        torch_save_pickle(
            {
                "loss_scaler": loss_scaler.LossScaler(scale=4.0),
                "dynamic": loss_scaler.DynamicLossScaler(8.0, 1000, 1.0, 2, False),
                "zero_stage": ZeroStageEnum.weights,
                "param_slice_mappings": [OrderedDict(w=fragment_address(numel=5, start=3))],
            }
        )
    )
    assert osd["zero_stage"] == 3 and type(osd["zero_stage"]) is int
    assert isinstance(osd["loss_scaler"], OpaqueRecord) and osd["loss_scaler"].cur_scale == 4.0
    assert "LossScaler (not imported)" in repr(osd["loss_scaler"])
    assert isinstance(osd["dynamic"], OpaqueRecord) and osd["dynamic"].cur_scale == 8.0
    address = osd["param_slice_mappings"][0]["w"]
    assert (address.numel, address.start) == (5, 3)


def test_lightning_attribute_dict_loads_as_dict():
    data = pytest.importorskip("lightning.fabric.utilities.data")
    hp = read(torch_save_pickle({"hyper_parameters": data.AttributeDict(lr=0.1, layers=[1, 2])}))["hyper_parameters"]
    assert type(hp) is dict and hp == {"lr": 0.1, "layers": [1, 2]}


@pytest.mark.slow
def test_reading_imports_nothing_it_names(tmp_path):
    """The stand-ins are used by name: reading a DeepSpeed file imports neither deepspeed nor torch, and a
    refused global's module is not imported either (``this`` prints the Zen of Python when it is)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    good = torch_save_pickle({"loss_scaler": LossScaler(scale=2.0), "w": torch.ones(2)})
    refused = b"\x80\x02cthis\ns\n)R."
    code = (
        "import sys\n"
        "from stagesafe.errors import UnsafeCheckpointError\n"
        "from stagesafe.zero.pickle_reader import read_pickle\n"
        "obj = read_pickle(bytes.fromhex(sys.argv[1]), display='f')\n"
        "assert obj['loss_scaler'].cur_scale == 2.0\n"
        "try:\n"
        "    read_pickle(bytes.fromhex(sys.argv[2]), display='f')\n"
        "except UnsafeCheckpointError as exc:\n"
        "    assert \"'this.s'\" in str(exc)\n"
        "print(sorted(m for m in ('deepspeed', 'torch', 'this', 'numpy') if m in sys.modules))\n"
    )
    result = run_python(code, good.hex(), refused.hex())
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


# -- what it refuses ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload,refused",
    [(lambda marker: _System(f"touch {marker}"), "'posix.system'"), (lambda marker: _Eval(), "'builtins.eval'")],
    ids=["os.system", "eval"],
)
def test_code_in_a_pickle_is_refused_not_run(tmp_path, payload, refused):
    marker = tmp_path / "pwned"
    # nested where a real file keeps data, beside real tensors
    data = torch_save_pickle({"optimizer_state_dict": {"fp32_flat_groups": [torch.ones(3)], "x": payload(marker)}})
    with pytest.raises(UnsafeCheckpointError) as info:
        read(data)
    message = str(info.value)
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in message and f"the global {refused}" in message
    assert "nothing from the file was executed" in message
    assert not marker.exists()
    assert isinstance(info.value, StageSafeError) and isinstance(info.value, ValueError)


def test_every_refused_global_is_named_and_a_users_class_is_not_among_them():
    data = torch_save_pickle({"a": _UserConfig(), "b": _System("true"), "c": [_UserConfig()], "d": _Eval()})
    with pytest.raises(UnsafeCheckpointError, match=r"the globals 'posix.system', 'builtins.eval', which") as info:
        read(data)
    assert "_UserConfig" not in str(info.value)


@pytest.mark.parametrize(
    "data,opcode",
    [
        (b"\x80\x02(X\x04\x00\x00\x00trueios\nsystem\n.", "INST"),
        (b"\x80\x02(ccollections\nOrderedDict\no.", "OBJ"),
        (b"\x80\x02\x82\x01.", "EXT1"),
        (b"\x80\x02P1\n.", "PERSID"),
        (b"I1\n.", "INT"),  # protocol 0's text opcodes are not what torch.save writes
        (b"\x80\x05\x97.", "NEXT_BUFFER"),
    ],
)
def test_an_opcode_outside_the_subset_is_refused_by_name(data, opcode):
    with pytest.raises(UnsafeCheckpointError, match=rf"the opcode {opcode} at byte \d+.*nothing from the file was executed"):
        read(data)


def test_allow_list_is_short_and_names_no_callable_of_os():
    assert len(ALLOWED_GLOBALS) <= 24
    assert not any(name.split(".")[0] in {"os", "posix", "nt", "subprocess", "sys", "importlib"} for name in ALLOWED_GLOBALS)
    builtins_allowed = {name for name in ALLOWED_GLOBALS if name.startswith(("builtins.", "_codecs."))}
    assert builtins_allowed == {"builtins.set", "builtins.frozenset", "builtins.bytes", "builtins.bytearray", "_codecs.encode"}


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
        "set of a dict key": _Calls(set, [[1]]),
        "torch.Size of strings": _Calls(torch.Size, ("a",)),
        "OrderedDict with items": _Calls(OrderedDict, [("a", 1)]),
    }


@pytest.mark.parametrize("case", range(7))
def test_allowed_classes_given_arguments_they_refuse_are_a_format_error(case):
    name, payload = list(_allowed_globals_misused().items())[case]
    with pytest.raises(CheckpointFormatError, match=r"optim_states\.pt cannot be read as a torch checkpoint file"):
        read(torch_save_pickle({"optimizer_state_dict": {"zero_stage": payload}}))


@pytest.mark.parametrize(
    "data,message",
    [
        (b"\x80\x02]q\x00.", "truncated|STOP"),  # no STOP... rather: cut before it
        (b"\x80\x02X\xff\xff\xff\x7fab.", "runs past its end"),
        (b"\x80\x02h\x07.", "memo slot 7"),
        (b"\x80\x02a.", "stack is empty"),
        (b"\x80\x02u.", "MARK"),
        (b"\x80\x02\x8b\x00\x00\x01\x00" + b"\x01" * 65536 + b".", "integer of 65536 bytes"),
        (b"\x80\x06N.", "protocol 6"),
        (b"\x80\x02}]K\x01aNs.", "key or set item"),  # a list as a dict key
        (b"\x80\x02}}b.", "BUILD of {}"),
    ],
    ids=["no_stop", "string_past_end", "memo", "empty_stack", "no_mark", "huge_int", "protocol", "list_key", "build_dict"],
)
def test_malformed_pickles_are_a_format_error_naming_the_byte(data, message):
    if message.startswith("truncated"):
        data = data[:-1]
    with pytest.raises(CheckpointFormatError, match=rf"optim_states\.pt cannot be read.*({message}).*at byte \d+"):
        read(data)


def test_a_key_nested_too_deep_to_hash_is_refused_without_hashing_it():
    """Hashing a tuple nested 300,000 deep overflows the C stack (SIGSEGV); such a key is refused first."""
    depth = 300_000  # deeper, its 56 bytes a level pass the memory budget first (tests/test_pickle_limits.py)
    data = b"\x80\x02}" + b")" + b"\x85" * depth + b"N" + b"s."  # {((((...)),): None}
    with pytest.raises(CheckpointFormatError, match="key or set item"):
        read(data)


def test_lists_sharing_their_items_at_every_level_cost_their_size_not_two_to_the_depth():
    """A list holding the previous one twice, 60 levels deep: 2**60 items if walked; errors show it bounded."""
    body = b"]q\x00K\x01a"  # memo 0: [1]
    for level in range(1, 61):  # memo level: [memo level-1, memo level-1], the one before popped
        body += b"0](h" + bytes([level - 1]) + b"h" + bytes([level - 1]) + b"eq" + bytes([level])
    data = b"\x80\x02}X\x14\x00\x00\x00optimizer_state_dict" + body + b"s."
    value = read(data)["optimizer_state_dict"]
    assert value[0] is value[1]
    from stagesafe.errors import shown

    assert len(shown(value, 80)) < 200


def test_a_storage_named_twice_with_two_types_is_refused():
    data = torch_save_pickle([torch.ones(2), torch.ones(3)])  # two storages: keys 0 and 1
    forged = data.replace(b"X\x01\x00\x00\x001", b"X\x01\x00\x00\x000")  # the second named as the first
    assert forged != data
    with pytest.raises(CheckpointFormatError, match="storage 0 is named as 2 float32 and as 3 float32"):
        read(forged)


# -- stand-ins keep the file's attributes as data ----------------------------------------------------------------

_PROTOCOL_NAMES = ("__deepcopy__", "__reduce_ex__", "__reduce__", "__getstate__", "__setstate__", "__copy__")


class Config:
    """A user's class whose pickled attributes are named as Python's protocol methods (a crafted state)."""

    def __init__(self, **state):
        self.state = state

    def __getstate__(self):
        return self.state


def test_a_stand_ins_attributes_named_as_protocol_methods_shadow_nothing():
    """A stand-in of the file's Config: deepcopy, pickle and torch.save of the hyperparameters holding it work,
    and its attributes read back as data."""
    state = {**{name: f"file's {name}" for name in _PROTOCOL_NAMES}, "lr": 0.1, "_private": 2}
    hparams = read(torch_save_pickle({"hparams": {"config": Config(**state)}}))["hparams"]
    config = hparams["config"]
    assert type(config) is OpaqueRecord and config._attributes == state and config.lr == 0.1
    with pytest.raises(AttributeError, match="_private"):
        config._private  # names starting with "_" are the record's own, never the file's
    copied = __import__("copy").deepcopy(hparams)
    assert copied["config"] is not config and copied["config"]._attributes == state
    assert pickle.loads(pickle.dumps(hparams))["config"]._attributes == state
    buffer = io.BytesIO()
    torch.save(hparams, buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)["config"].lr == 0.1


class _NamespaceOf:
    """Pickles as an ``argparse.Namespace`` or ``OrderedDict`` whose attributes are ``state``."""

    def __init__(self, kind, state):
        self.kind, self.state = kind, state

    def __reduce__(self):
        return (self.kind, (), self.state)


@pytest.mark.parametrize("kind", [__import__("argparse").Namespace, OrderedDict])
@pytest.mark.parametrize("name", ["__deepcopy__", "__reduce_ex__"])
def test_a_real_object_given_an_attribute_named_as_a_protocol_method_is_refused(kind, name):
    """A namespace is a real object: the file's ``__reduce_ex__`` would be what pickle calls on it."""
    with pytest.raises(CheckpointFormatError, match=f"the attribute '{name}', which would shadow"):
        read(torch_save_pickle({"hparams": _NamespaceOf(kind, {name: "x", "lr": 0.1})}))
    assert vars(read(torch_save_pickle({"ns": _NamespaceOf(kind, {"lr": 0.1})}))["ns"]) == {"lr": 0.1}


def test_stand_ins_given_one_state_share_it_instead_of_copying_it():
    """Two objects whose pickled state is one dict (the pickle's memo): the stand-ins share it, as the pickle does."""
    first, second = Config(), Config()
    first.state = second.state = {"lr": 0.1, "betas": (0.9, 0.99)}
    one, two = read(torch_save_pickle([first, second]))
    assert one._attributes is two._attributes and one.lr == 0.1
