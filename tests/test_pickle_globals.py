"""The allow-list of the pickle reader (stagesafe/zero/pickle_globals.py), rule by rule on plain arguments: each
allowed global builds the inert value it stands for (checked against torch where torch says what it is), every
argument a rule does not read is refused as ``Malformed``, and a name outside the table stands for nothing."""

from __future__ import annotations

import datetime
import pathlib
from collections import OrderedDict

import numpy as np
import pytest
import torch

from stagesafe.zero.pickle_globals import (
    ALLOWED_GLOBALS,
    FLOATING,
    ITEMSIZE,
    Malformed,
    OpaqueRecord,
    Refused,
    StorageRef,
    StorageType,
    TensorRecord,
    TorchDevice,
    TorchDType,
    TorchSize,
    attributes_of,
    count,
    find_global,
    plain_key,
    set_state,
)

pytestmark = pytest.mark.timeout(60)

STORAGE = StorageRef("0", "float32", 24)
NO_HOOKS = OrderedDict()


def call(name: str, *args):
    """What the pickle's ``REDUCE`` of the global ``name`` with ``args`` builds."""
    return find_global(name).call(args)


# -- the values: what torch says of its dtypes and tensors -----------------------------------------------------------


def test_every_dtype_has_torchs_itemsize_and_floating_is_torchs_is_floating_point():
    for name, size in ITEMSIZE.items():
        if hasattr(torch, name):  # the newest float8 kinds are missing from older torch
            assert getattr(torch, name).itemsize == size, name
            assert (name in FLOATING) == getattr(torch, name).is_floating_point, name
    assert StorageRef("k", "bfloat16", 5).nbytes == 10


@pytest.mark.parametrize(
    "shape,stride",
    [((4, 6), (6, 1)), ((3, 3), (1, 3)), ((1, 5), (99, 1)), ((2, 1, 3), (3, 7, 1)), ((0, 4), (9, 9)), ((4,), (0,)),
     ((2, 3), (6, 2)), ((), ())],
)
def test_a_records_contiguity_and_span_are_torchs(shape, stride):
    record = TensorRecord(STORAGE, 0, shape, stride, "float32")
    real = torch.empty_strided(shape, stride)
    assert record.is_contiguous() == real.is_contiguous()
    assert record.numel == real.numel()
    if real.numel():  # torch allocates exactly the elements the strides reach
        assert record.span() == real.untyped_storage().nbytes() // real.itemsize
    flat = record.flat()
    assert flat.shape == (record.numel,) and flat.stride == (1,) and flat.storage is STORAGE


# -- the tensor builders ---------------------------------------------------------------------------------------------


def test_rebuild_tensor_v2_is_a_record_of_its_storage_offset_size_and_stride():
    record = call("torch._utils._rebuild_tensor_v2", STORAGE, 2, (2, 3), (3, 1), True, NO_HOOKS)
    assert (record.storage, record.offset, record.shape, record.stride) == (STORAGE, 2, (2, 3), (3, 1))
    assert record.dtype == "float32" and record.requires_grad and not record.parameter and dict(record.attributes) == {}
    with_metadata = call("torch._utils._rebuild_tensor_v2", STORAGE, 0, (2,), (1,), False, {}, {})
    assert with_metadata.shape == (2,)


def test_rebuild_tensor_v3_takes_its_dtype_apart_from_the_untyped_storage():
    untyped = StorageRef("1", "uint8", 12)
    record = call("torch._utils._rebuild_tensor_v3", untyped, 0, (6,), (1,), False, NO_HOOKS, TorchDType("uint16"))
    assert record.dtype == "uint16" and record.itemsize == 2 and record.storage is untyped


@pytest.mark.parametrize(
    "args",
    [
        (STORAGE, 0, (2,), (1,), False),  # five arguments
        (STORAGE, 0, (2,), (1,), False, NO_HOOKS, {"conj": True}),  # a lazily conjugated view
        ("not a storage", 0, (2,), (1,), False, NO_HOOKS),
        (STORAGE, -1, (2,), (1,), False, NO_HOOKS),
        (STORAGE, 0, (2, 3), (1,), False, NO_HOOKS),  # sizes and strides of different lengths
        (STORAGE, 0, (2**40, 2**40), (1, 1), False, NO_HOOKS),  # more elements than any file
        (STORAGE, 0, (2,), (1,), 1, NO_HOOKS),  # requires_grad not a bool
        (STORAGE, 0, (2,), (1,), False, OrderedDict(hook=1)),  # backward hooks
        (STORAGE, 0, [2], (1,), False, NO_HOOKS),  # a size that is a list
        (STORAGE, 0, (2.0,), (1,), False, NO_HOOKS),
    ],
    ids=["arity", "metadata", "storage", "offset", "dims", "huge", "requires_grad", "hooks", "list_size", "float_size"],
)
def test_rebuild_tensor_refuses_what_torch_save_never_writes(args):
    with pytest.raises(Malformed):
        call("torch._utils._rebuild_tensor_v2", *args)


def test_rebuild_tensor_v3_refuses_a_dtype_that_is_not_a_dtype():
    with pytest.raises(Malformed, match="dtype"):
        call("torch._utils._rebuild_tensor_v3", STORAGE, 0, (2,), (1,), False, NO_HOOKS, "float32")


def test_parameters_keep_requires_grad_and_their_pickled_attributes():
    data = call("torch._utils._rebuild_tensor_v2", STORAGE, 0, (2,), (1,), False, NO_HOOKS)
    param = call("torch._utils._rebuild_parameter", data, False, NO_HOOKS)
    assert param.parameter and not param.requires_grad and param.shape == (2,)
    with_state = call("torch._utils._rebuild_parameter_with_state", data, True, NO_HOOKS, {"ds_id": 7})
    assert with_state.parameter and with_state.requires_grad and dict(with_state.attributes) == {"ds_id": 7}
    with pytest.raises(Malformed, match="not a tensor"):
        call("torch._utils._rebuild_parameter", "data", True, NO_HOOKS)
    with pytest.raises(Malformed, match="requires_grad"):
        call("torch._utils._rebuild_parameter", data, None, NO_HOOKS)
    with pytest.raises(Malformed, match="dict of attributes"):
        call("torch._utils._rebuild_parameter_with_state", data, True, NO_HOOKS, [1])


def test_rebuild_from_type_v2_is_the_inner_tensor_with_its_python_attributes():
    inner = (STORAGE, 0, (3,), (1,), False, NO_HOOKS)
    v2, parameter = find_global("torch._utils._rebuild_tensor_v2"), find_global("torch.nn.parameter.Parameter")
    record = call("torch._tensor._rebuild_from_type_v2", v2, parameter, inner, {"ds_id": 3})
    assert record.parameter and dict(record.attributes) == {"ds_id": 3} and record.shape == (3,)
    plain = call("torch._tensor._rebuild_from_type_v2", v2, find_global("torch.Tensor"), inner, None)
    assert not plain.parameter and dict(plain.attributes) == {}
    with pytest.raises(Malformed):  # a builder outside the tensor builders
        call("torch._tensor._rebuild_from_type_v2", find_global("torch.Size"), parameter, ((2,),), None)


def test_a_refused_storage_or_builder_makes_a_refused_tensor_and_nothing_is_called():
    refused = Refused("os.system")
    assert call("torch._utils._rebuild_tensor_v2", refused, 0, (2,), (1,), False, NO_HOOKS) is refused
    assert call("torch._utils._rebuild_parameter", refused, True, NO_HOOKS) is refused
    assert call("torch._tensor._rebuild_from_type_v2", refused, find_global("torch.Tensor"), (), None) is refused


# -- containers, bytes, shapes and devices ---------------------------------------------------------------------------


def test_containers_and_bytes_are_what_pickle_protocol_2_makes_of_them():
    assert call("collections.OrderedDict") == OrderedDict() and type(call("collections.OrderedDict")) is OrderedDict
    assert call("builtins.set", [1, "a", (2, 3)]) == {1, "a", (2, 3)} and call("builtins.set") == set()
    assert type(call("builtins.frozenset", [1, 2])) is frozenset
    assert call("builtins.bytes") == b""
    assert call("builtins.bytearray", b"ab") == bytearray(b"ab") and call("builtins.bytearray") == bytearray()
    assert call("_codecs.encode", "\xffA", "latin1") == b"\xffA" == call("_codecs.encode", "\xffA", "latin-1")


@pytest.mark.parametrize(
    "name,args",
    [
        ("collections.OrderedDict", ([("a", 1)],)),
        ("builtins.set", ([[1]],)),  # a list is no set item
        ("builtins.set", ((1, 2),)),  # items as a tuple, not the list protocol 2 writes
        ("builtins.bytes", (b"x",)),
        ("builtins.bytearray", ("ab",)),
        ("_codecs.encode", ("ab", "utf-8")),
        ("torch.Size", ((2, -1),)),
        ("torch.Size", ((2,), (3,))),
        ("torch.device", ("cuda", 2**16)),
        ("torch.device", ("cuda", "0")),
        ("torch.device", ("x" * 65,)),
        ("deepspeed.runtime.zero.config.ZeroStageEnum", ("3",)),
        ("deepspeed.runtime.fp16.loss_scaler.LossScaler", (1.0,)),
        ("lightning.fabric.utilities.data.AttributeDict", ({"a": 1},)),
    ],
)
def test_an_allowed_global_refuses_arguments_it_does_not_read(name, args):
    with pytest.raises(Malformed):
        call(name, *args)


def test_latin1_encoding_refuses_a_character_past_ff():
    with pytest.raises(UnicodeEncodeError):  # a ValueError: the reader reports the pickle as malformed
        call("_codecs.encode", "\u0100", "latin1")


def test_sizes_and_devices_are_inert_and_equal_torchs():
    size = call("torch.Size", (2, 3))
    assert isinstance(size, TorchSize) and size == torch.Size((2, 3)) and size == (2, 3)
    device = call("torch.device", "cuda", 1)
    assert device == TorchDevice("cuda", 1) and torch.device(device.type, device.index) == torch.device("cuda:1")
    assert call("torch.device", "cpu") == TorchDevice("cpu", None)


def test_deepspeed_and_lightning_classes_stand_in_without_being_imported():
    assert call("deepspeed.runtime.zero.config.ZeroStageEnum", 3) == 3
    for name in ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.utils.tensor_fragment.fragment_address"):
        rule = find_global(name)
        made, new = rule.call(()), rule.new(())
        assert isinstance(made, OpaqueRecord) and made._stands_for == name and made._known
        assert made is not new and new._stands_for == name
    for name in ("lightning.fabric.utilities.data.AttributeDict", "pytorch_lightning.utilities.parsing.AttributeDict"):
        assert type(find_global(name).new(())) is dict


# -- the table -------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_values_in_the_table_are_dtypes_storage_types_and_tensor_types_as_torch_has_them():
    assert find_global("torch.bfloat16") == TorchDType("bfloat16")
    for storage in ("FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "BoolStorage"):
        assert find_global(f"torch.{storage}") == StorageType(str(getattr(torch, storage).dtype).removeprefix("torch."))
    assert find_global("torch.UntypedStorage") == StorageType("uint8") == find_global("torch.storage.UntypedStorage")
    assert find_global("torch.nn.parameter.Parameter").parameter and not find_global("torch.Tensor").parameter


@pytest.mark.parametrize(
    "name",
    ["os.system", "builtins.eval", "builtins.getattr", "torch.load", "torch.storage._load_from_bytes",
     "torch._utils._rebuild_device_tensor_from_numpy", "numpy.core.multiarray._reconstruct", "collections.Counter",
     "torch.float32.__class__", "torch"],
)
def test_a_name_outside_the_table_stands_for_nothing(name):
    assert find_global(name) is None
    assert name not in ALLOWED_GLOBALS


# -- the checks the rules share --------------------------------------------------------------------------------------


def test_count_takes_ints_from_zero_to_two_to_the_62():
    assert count(0, "x") == 0 and count(2**62, "x") == 2**62
    for bad in (-1, 2**62 + 1, True, 1.0, "1", None):
        with pytest.raises(Malformed, match="not a count"):
            count(bad, "an offset")


def test_plain_keys_are_cheap_to_hash_and_anything_else_is_refused():
    record = OpaqueRecord("user.Key")
    plain = [1, "a", 1.5, None, b"x", TorchDType("int8"), TorchDevice("cpu"), (1, "a"), TorchSize((2, 3)),
             pathlib.PurePosixPath("/x"), datetime.date(2026, 1, 1), np.int64(3), np.float32(1.0), record]
    for key in plain:
        assert plain_key(key) is key
    for key in ([1], {"a": 1}, ((1,),), tuple(range(65)), OrderedDict()):
        with pytest.raises(Malformed, match="not a plain value"):
            plain_key(key)


def test_attributes_are_a_dict_of_names_or_a_dict_and_slots_pair():
    assert attributes_of({"a": 1}) == {"a": 1} and attributes_of(None) == {}
    assert attributes_of((None, {"s": 2})) == {"s": 2} and attributes_of(({"a": 1}, {"s": 2})) == {"a": 1, "s": 2}
    for bad in ({1: 2}, [("a", 1)], ({"a": 1},), ({"a": 1}, {2: 3})):
        with pytest.raises(Malformed, match="dict of attributes"):
            attributes_of(bad)


def test_build_of_a_stand_in_sets_attributes_or_keeps_a_state_that_is_not_attributes():
    users = OpaqueRecord("user.Thing")
    set_state(users, {"lr": 0.1})
    assert users.lr == 0.1
    set_state(users, [1, 2])
    assert users._state == [1, 2]
    known = OpaqueRecord("deepspeed.runtime.fp16.loss_scaler.LossScaler", known=True)
    set_state(known, {"cur_scale": 1.0})
    assert known.cur_scale == 1.0
    with pytest.raises(Malformed):  # an allow-listed class's state must be attributes
        set_state(known, [1, 2])
