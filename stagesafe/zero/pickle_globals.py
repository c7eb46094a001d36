"""What DeepSpeed's pickles hold, as :mod:`stagesafe.zero.pickle_reader` builds it without torch: the values,
and the rule each allowed torch, DeepSpeed or Lightning global stands for.

A pickle names globals (``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict``, DeepSpeed's
``LossScaler``) for the unpickler to import and call. Here each allowed name maps to a rule of this module, a
function of plain values that builds an inert value: a tensor becomes a :class:`TensorRecord` (where its bytes
are, nothing read), ``torch.Size`` a :class:`TorchSize`, a dtype a :class:`TorchDType`, an allowed DeepSpeed
class an :class:`OpaqueRecord` holding the pickled attributes. Nothing is imported by the name a file gives.
Each rule checks its arguments and raises :class:`Malformed` for any it refuses. The values users keep in
hyperparameters have rules of their own (:mod:`.pickle_user_values`); what a name outside both tables stands
for, :mod:`.pickle_policy` says (a :class:`NamedGlobal`, instantiated as an :class:`OpaqueRecord`, or
:class:`Refused`).
"""

from __future__ import annotations

import datetime
import itertools
import math
import pathlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from stagesafe.errors import shown
from stagesafe.zero.pickle_limits import HashSpread

__all__ = [
    "ALLOWED_GLOBALS",
    "FLOATING",
    "ITEMSIZE",
    "Malformed",
    "NamedGlobal",
    "OpaqueRecord",
    "Pending",
    "Refused",
    "Rule",
    "StorageRef",
    "StorageType",
    "TensorRecord",
    "TorchDType",
    "TorchDevice",
    "TorchSize",
    "attributes_of",
    "count",
    "instance_attributes",
    "find_global",
    "plain_key",
    "set_state",
]

# dtype (as torch names it, without "torch.") -> bytes per element: every dtype a rank file's tensor may have.
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}
FLOATING = frozenset(name for name in ITEMSIZE if name.startswith(("float", "bfloat")))  # torch's is_floating_point

# torch.<X>Storage, the typed storages torch.save names for the dtypes that have one -> their dtype.
_STORAGE_TYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
_MAX_DIMS = 64
_MAX_COUNT = 2**62  # no size, stride, offset or element count of a real file comes near
_MAX_KEY_ITEMS = 64  # items of a tuple used as a dict key or set item


# -- the values it builds --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A tensor storage as the pickle names it: its bytes are the archive's record ``data/<key>``."""

    key: str
    dtype: str  # "uint8" for an untyped storage
    numel: int  # in elements of dtype

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


_NO_ATTRIBUTES: Mapping[str, Any] = MappingProxyType({})  # shared by the records of tensors without attributes


@dataclass(frozen=True, eq=False, slots=True)
class TensorRecord:
    """A tensor of the pickle, not read: ``shape`` elements of ``dtype`` at ``stride`` from element ``offset`` of
    ``storage``. ``attributes`` are the Python attributes pickled with it (DeepSpeed's ``ds_id``), kept inert."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    parameter: bool = False
    attributes: Mapping[str, Any] = field(default_factory=lambda: _NO_ATTRIBUTES)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        """As ``torch.Tensor.is_contiguous``: row-major strides, sizes of 1 ignored, empty tensors always."""
        if 0 in self.shape:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def span(self) -> int:
        """Elements of the storage a non-empty record reaches, from its first: 1 + sum of (size - 1) * stride."""
        return 1 + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride))

    def flat(self) -> TensorRecord:
        """The contiguous record as one dimension (``tensor.view(-1)``)."""
        return replace(self, shape=(self.numel,), stride=(1,))

    def __repr__(self) -> str:
        return f"<tensor {self.dtype}{list(self.shape)[:8]} of storage {self.storage.key}, not read>"


class OpaqueRecord:
    """Stands in for an object of a class the reader does not import: a DeepSpeed loss scaler (allow-listed), or a
    user's Enum member or dataclass (a warning names it). It runs no code and keeps what the pickle says of the
    object: ``_stands_for`` (the class's full name), ``_args`` (what it was called or instantiated with: an Enum
    member's value), ``_attributes`` (the pickled attributes, a dict: a dataclass's fields), ``_state`` (a state
    that is not attributes) and ``_items`` (the items of a list or dict subclass). An attribute whose name does not
    start with ``_`` reads as the record's own (``record.lr``); the file's attributes are data, never Python
    attributes, so none of them (a ``__deepcopy__`` or ``__reduce__`` of the file's) shadows what ``copy``,
    ``pickle`` and ``torch.save`` look up on the record. Its hash is its identity, so a record used as a dict key
    costs one hash, whatever it holds."""

    __slots__ = ("_stands_for", "_args", "_state", "_items", "_known", "_attributes")

    def __init__(self, stands_for: str, args: tuple = (), *, known: bool = False):
        self._stands_for = stands_for
        self._args = args
        self._state: Any = None
        self._items: Any = None
        self._known = known  # allow-listed: built without a warning, its state must be attributes
        self._attributes: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:  # only for names the class does not have
        if not name.startswith("_"):
            try:
                return self._attributes[name]
            except KeyError:
                pass
        raise AttributeError(f"the stand-in has no attribute {name!r} (the file's attributes: ._attributes)")

    def __shown__(self) -> tuple[str, Any, str, bool]:  # stagesafe._shown: within the message's budget
        own = [(name, value) for name, value in (("_args", self._args), ("_state", self._state)) if value]
        return f"<{self._stands_for} (not imported) {{", itertools.chain(own, self._attributes.items()), "}>", True

    def __repr__(self) -> str:
        return shown(self, 200)


class NamedGlobal(OpaqueRecord):
    """A global outside the table, as a value (a class or function a pickle names, never imported). Applying a
    class's name builds an :class:`OpaqueRecord` of it; ``class_like``: the name is a class's (capitalised)."""

    __slots__ = ("class_like",)

    def __init__(self, full_name: str, *, class_like: bool):
        super().__init__(full_name)
        self.class_like = class_like

    def __shown__(self) -> tuple[str, Any, str, bool]:
        return f"<{self._stands_for} (not imported)", (), ">", False


class Pending:
    """A value that a later ``BUILD`` completes (a numpy dtype's byte order, an array's bytes): ``build(state)``
    returns the value, which replaces this one on the stack and in the memo."""

    def build(self, state: Any) -> Any:
        raise NotImplementedError


def set_state(record: OpaqueRecord, state: Any) -> None:
    """``BUILD`` of a stand-in: attributes become its ``_attributes``; an allow-listed class's state must be
    attributes, another state is kept as ``_state``."""
    if record._known or _is_attributes(state):
        if not record._attributes and type(state) is dict and _is_names(state):
            record._attributes = state  # shared, as the pickle shares it: a state given to many objects is not copied
        else:  # a new dict: one shared with other records stays as it is
            record._attributes = {**record._attributes, **attributes_of(state)}
    else:
        record._state = state


class TorchSize(tuple):
    """``torch.Size`` as pickled: a tuple of its sizes."""

    __slots__ = ()


@dataclass(frozen=True)
class TorchDType:
    """A ``torch.<dtype>`` global, by name."""

    name: str


@dataclass(frozen=True)
class TorchDevice:
    """``torch.device(type, index)`` as pickled."""

    type: str
    index: int | None = None


# -- the table of globals ----------------------------------------------------------------------------------------------


class Malformed(Exception):
    """A rule refused its arguments, or the pickle is otherwise not one torch.save writes: said in the message."""


@dataclass(frozen=True)
class Rule:
    """What an allowed global stands for: ``REDUCE`` calls ``call(args)``, ``NEWOBJ`` calls ``new(args)``; both
    are this module's functions of plain values. A global that is a value (a dtype) has neither."""

    name: str
    call: Callable[[tuple], Any] | None = None
    new: Callable[[tuple], Any] | None = None


@dataclass(frozen=True)
class StorageType:
    """A ``torch.<X>Storage`` global (``UntypedStorage``: uint8), as a persistent id names it."""

    dtype: str


@dataclass(frozen=True)
class _TensorType:
    """``torch.Tensor`` or ``torch.nn.Parameter``, as the type ``_rebuild_from_type_v2`` makes."""

    parameter: bool


class Refused:
    """Where a global outside the table was named: everything built from it is this too, so that reading goes on
    to list every refused global, and nothing is called."""

    def __init__(self, name: str):
        self.name = name


def count(value: Any, what: str) -> int:
    """``value`` if it is an int from 0 to 2**62 (a size, a stride, an offset), else :class:`Malformed`."""
    if type(value) is not int or not 0 <= value <= _MAX_COUNT:
        raise Malformed(f"{what} is {shown(value, 60)}, not a count")
    return value


def _sizes(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > _MAX_DIMS:
        raise Malformed(f"{what} is {shown(value, 60)}, not a tuple of at most {_MAX_DIMS} sizes")
    return tuple(count(v, what) for v in value)


def _no_hooks(value: Any) -> None:
    if type(value) not in (dict, OrderedDict) or value:
        raise Malformed(f"backward hooks {shown(value, 60)} where torch.save writes an empty OrderedDict")


def attributes_of(value: Any) -> dict[str, Any]:
    """Pickled attributes: a dict of str keys, or ``(dict or None, slots dict)`` as objects with ``__slots__``
    give; else :class:`Malformed`."""
    if not _is_attributes(value):
        raise Malformed(f"the state {shown(value, 60)} is not a dict of attributes")
    if type(value) is tuple:
        return {**(value[0] or {}), **value[1]}
    return dict(value or {})


def instance_attributes(value: Any) -> dict[str, Any]:
    """:func:`attributes_of` for a real Python object's ``__dict__`` (an ``argparse.Namespace``, an
    ``OrderedDict``'s): a name of Python's protocols (``__reduce_ex__``, ``__deepcopy__``) is refused, as the
    file's value would shadow the method that ``copy``, ``pickle`` and ``torch.save`` call."""
    attributes = attributes_of(value)
    for name in attributes:
        if name.startswith("__") and name.endswith("__"):
            raise Malformed(f"the attribute {shown(name, 60)}, which would shadow one of Python's protocol methods")
    return attributes


def _is_attributes(value: Any) -> bool:
    if type(value) is tuple:
        return len(value) == 2 and (value[0] is None or _is_names(value[0])) and _is_names(value[1])
    return value is None or _is_names(value)


def _is_names(value: Any) -> bool:
    return type(value) in (dict, OrderedDict) and all(type(k) is str for k in value)


def _tensor(args: tuple, *, v3: bool) -> TensorRecord | Refused:
    """``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])``, or
    ``_v3`` (``..., hooks, dtype[, metadata]``), whose storage is untyped and whose dtype is given apart."""
    fixed = 7 if v3 else 6
    if len(args) not in (fixed, fixed + 1):
        raise Malformed(f"a tensor rebuilt from {len(args)} arguments, where torch.save writes {fixed} or {fixed + 1}")
    storage, offset, size, stride, requires_grad, hooks = args[:6]
    if isinstance(storage, Refused):
        return storage
    if not isinstance(storage, StorageRef):
        raise Malformed(f"a tensor of the storage {shown(storage, 60)}, which is not a storage of the archive")
    dtype = storage.dtype
    if v3:
        if not isinstance(args[6], TorchDType):
            raise Malformed(f"a tensor of dtype {shown(args[6], 60)}")
        dtype = args[6].name
    metadata = args[fixed] if len(args) > fixed else None
    if metadata not in (None, {}):  # torch.save writes {"conj": ..., "neg": ...} only for lazily negated views
        raise Malformed(f"tensor metadata {shown(metadata, 60)} (a conjugate or negative view)")
    shape, strides = _sizes(size, "a tensor's size"), _sizes(stride, "a tensor's stride")
    if len(shape) != len(strides):
        raise Malformed(f"a tensor of size {list(shape)[:8]} with strides {list(strides)[:8]}")
    numel = 1
    for d in shape:
        numel = min(numel * d, _MAX_COUNT + 1)
    if numel > _MAX_COUNT:
        raise Malformed(f"a tensor of size {list(shape)[:8]}, far more elements than any file holds")
    if type(requires_grad) is not bool:
        raise Malformed(f"requires_grad is {shown(requires_grad, 60)}")
    _no_hooks(hooks)
    return TensorRecord(storage, count(offset, "a storage offset"), shape, strides, dtype, requires_grad)


def _tensor_of(value: Any) -> TensorRecord:
    if not isinstance(value, TensorRecord):
        raise Malformed(f"a parameter of {shown(value, 60)}, which is not a tensor")
    return value


def _parameter(args: tuple) -> TensorRecord | Refused:
    """``torch._utils._rebuild_parameter(data, requires_grad, hooks)``."""
    if len(args) != 3:
        raise Malformed(f"a parameter rebuilt from {len(args)} arguments")
    if isinstance(args[0], Refused):
        return args[0]
    _no_hooks(args[2])
    if type(args[1]) is not bool:
        raise Malformed(f"requires_grad is {shown(args[1], 60)}")
    return replace(_tensor_of(args[0]), parameter=True, requires_grad=args[1])


def _parameter_with_state(args: tuple) -> TensorRecord | Refused:
    """``torch._utils._rebuild_parameter_with_state(data, requires_grad, hooks, state)``."""
    if len(args) != 4:
        raise Malformed(f"a parameter rebuilt from {len(args)} arguments")
    record = _parameter(args[:3])
    return record if isinstance(record, Refused) else replace(record, attributes=attributes_of(args[3]))


def _from_type(args: tuple) -> TensorRecord | Refused:
    """``torch._tensor._rebuild_from_type_v2(func, new_type, args, state)``: a tensor with Python attributes."""
    if len(args) != 4:
        raise Malformed(f"_rebuild_from_type_v2 with {len(args)} arguments")
    func, new_type, inner, attributes = args
    for part in (func, new_type):
        if isinstance(part, Refused):
            return part
    if not isinstance(func, Rule) or func.name not in _TENSOR_BUILDERS or not isinstance(new_type, _TensorType):
        raise Malformed(f"_rebuild_from_type_v2 of {shown(func, 60)} as {shown(new_type, 60)}")
    if type(inner) is not tuple:
        raise Malformed(f"_rebuild_from_type_v2 with the arguments {shown(inner, 60)}")
    record = func.call(inner)
    if isinstance(record, Refused):
        return record
    return replace(record, parameter=record.parameter or new_type.parameter, attributes=attributes_of(attributes))


def _plain(kind: type, args: tuple) -> Any:
    """``set(items)``, ``frozenset(items)``: items as a list, each a plain value, few of them of one hash."""
    if args == ():
        return kind()
    if len(args) != 1 or type(args[0]) is not list:
        raise Malformed(f"{kind.__name__} of {shown(args, 60)}")
    items, spread = [plain_key(item) for item in args[0]], HashSpread()
    for item in items:
        spread.check(None, item)
    return kind(items)


def _only(value: Any, *args_allowed: tuple) -> Callable[[tuple], Any]:
    def build(args: tuple) -> Any:
        if args not in args_allowed:
            raise Malformed(f"arguments {shown(args, 60)}, where only {shown(args_allowed, 60)} are read")
        return value() if callable(value) else value

    return build


def _encode(args: tuple) -> bytes:
    """``_codecs.encode(text, "latin1")``: how protocol 2 pickles a non-empty ``bytes``."""
    if len(args) != 2 or type(args[0]) is not str or args[1] not in ("latin1", "latin-1"):
        raise Malformed(f"_codecs.encode{shown(args, 60)}; only (str, 'latin1') is read")
    return args[0].encode("latin1")  # a character past U+00FF is a UnicodeEncodeError: malformed


def _bytearray(args: tuple) -> bytearray:
    if args == ():
        return bytearray()
    if len(args) != 1 or type(args[0]) is not bytes:
        raise Malformed(f"bytearray{shown(args, 60)}")
    return bytearray(args[0])


def _size(args: tuple) -> TorchSize:
    if len(args) != 1:
        raise Malformed(f"torch.Size{shown(args, 60)}")
    return TorchSize(_sizes(args[0], "a torch.Size"))


def _device(args: tuple) -> TorchDevice:
    if not 1 <= len(args) <= 2 or type(args[0]) is not str or len(args[0]) > 64:
        raise Malformed(f"torch.device{shown(args, 60)}")
    index = args[1] if len(args) == 2 else None
    if index is not None and (type(index) is not int or not 0 <= index < 2**16):
        raise Malformed(f"torch.device{shown(args, 60)}")
    return TorchDevice(args[0], index)


def _zero_stage(args: tuple) -> int:
    """``ZeroStageEnum(n)``, an IntEnum: its value."""
    if len(args) != 1 or type(args[0]) is not int:
        raise Malformed(f"ZeroStageEnum{shown(args, 60)}")
    return args[0]


def _stand_in(full_name: str) -> Rule:
    build = _only(lambda: OpaqueRecord(full_name, known=True), ())
    return Rule(full_name, call=build, new=build)


def _dict_like(full_name: str) -> Rule:
    """A dict subclass (Lightning's AttributeDict): a plain dict holds the same items."""
    return Rule(full_name, call=_only(dict, ()), new=_only(dict, ()))


_TENSOR_BUILDERS = {
    "torch._utils._rebuild_tensor_v2": lambda args: _tensor(args, v3=False),
    "torch._utils._rebuild_tensor_v3": lambda args: _tensor(args, v3=True),
    "torch._utils._rebuild_parameter": _parameter,
    "torch._utils._rebuild_parameter_with_state": _parameter_with_state,
}

# The globals this reader builds something for, as the pickle names them -> the rule. Keep this short and say why.
ALLOWED_GLOBALS: dict[str, Rule] = {
    **{name: Rule(name, call=build) for name, build in _TENSOR_BUILDERS.items()},
    # A tensor with Python attributes: DeepSpeed's ZeRO-3 flat fp32 groups carry a ds_id.
    "torch._tensor._rebuild_from_type_v2": Rule("torch._tensor._rebuild_from_type_v2", call=_from_type),
    # Containers as protocol 2 pickles them.
    "collections.OrderedDict": Rule("collections.OrderedDict", call=_only(OrderedDict, ())),
    "builtins.set": Rule("builtins.set", call=lambda args: _plain(set, args)),
    "builtins.frozenset": Rule("builtins.frozenset", call=lambda args: _plain(frozenset, args)),
    "builtins.bytes": Rule("builtins.bytes", call=_only(b"", ())),
    "builtins.bytearray": Rule("builtins.bytearray", call=_bytearray),
    "_codecs.encode": Rule("_codecs.encode", call=_encode),
    # Shapes (DeepSpeed's param_shapes) and devices, as inert values.
    "torch.Size": Rule("torch.Size", call=_size),
    "torch.device": Rule("torch.device", call=_device),
    # ZeRO optimizer state: the zero_stage (an IntEnum: its int), the loss scaler object (fp32/bf16: LossScaler;
    # fp16: DynamicLossScaler), param_slice_mappings' values (ZeRO-1/2, a small dataclass of numel and start).
    "deepspeed.runtime.zero.config.ZeroStageEnum": Rule(
        "deepspeed.runtime.zero.config.ZeroStageEnum", call=_zero_stage
    ),
    **{
        name: _stand_in(name)
        for name in (
            "deepspeed.runtime.fp16.loss_scaler.LossScaler",
            "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
            "deepspeed.utils.tensor_fragment.fragment_address",
        )
    },
    # Lightning's client state: hyper_parameters is an AttributeDict.
    **{
        name: _dict_like(name)
        for name in (
            "lightning.fabric.utilities.data.AttributeDict",
            "lightning_fabric.utilities.data.AttributeDict",
            "pytorch_lightning.utilities.parsing.AttributeDict",
        )
    },
}
# Globals that are values, not callables: dtypes, storage types, the tensor types _rebuild_from_type_v2 makes.
_VALUES: dict[str, Any] = {
    **{f"torch.{name}": TorchDType(name) for name in ITEMSIZE},
    **{f"torch.{name}": StorageType(dtype) for name, dtype in _STORAGE_TYPES.items()},
    "torch.UntypedStorage": StorageType("uint8"),
    "torch.storage.UntypedStorage": StorageType("uint8"),
    "torch.Tensor": _TensorType(parameter=False),
    "torch.nn.parameter.Parameter": _TensorType(parameter=True),
}

_KEY_TYPES = frozenset({str, int, float, bool, type(None), bytes, TorchDType, TorchDevice})
# Values of the standard library that may be keys too: their hash is cheap and not recursive.
_VALUE_KEY_TYPES = (pathlib.PurePath, datetime.date, datetime.time, datetime.timedelta, datetime.tzinfo)
_IDENTITY_OR_VALUE_KEYS = (Refused, OpaqueRecord, *_VALUE_KEY_TYPES)


def find_global(full_name: str) -> Any:
    """What the torch, DeepSpeed or Lightning global ``full_name`` (``module.name``) stands for: a :class:`Rule`,
    or a value (a dtype, a storage type, a tensor type); None if the table does not have it."""
    return ALLOWED_GLOBALS.get(full_name, _VALUES.get(full_name))


def plain_key(value: Any) -> Any:
    """``value`` if it may be a dict key or set item: a plain value (a number, a string, a path, a date, a numpy
    number, a stand-in, which hashes as its identity), or a short tuple of plain values, else :class:`Malformed`.
    Hashing such a key is cheap and never recursive (hashing a tuple nested a million deep overflows the C stack);
    DeepSpeed's keys are str and int."""
    if type(value) in _KEY_TYPES or isinstance(value, _IDENTITY_OR_VALUE_KEYS) or _numpy_number(value):
        return value
    if type(value) in (tuple, TorchSize) and len(value) <= _MAX_KEY_ITEMS and all(type(v) in _KEY_TYPES for v in value):
        return value
    raise Malformed(f"a dict key or set item {shown(value, 60)} that is not a plain value")


def _numpy_number(value: Any) -> bool:
    """A numpy bool, integer, float or complex scalar (its hash is the Python number's)."""
    return type(value).__module__ == "numpy" and getattr(getattr(value, "dtype", None), "kind", "") in "biufc"
