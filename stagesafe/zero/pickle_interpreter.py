"""The interpreter of the opcodes ``torch.save`` writes, for :mod:`stagesafe.zero.pickle_reader`: one
:class:`Interpreter` per pickle (a stack, marks, the memo, as in ``pickle._Unpickler``), one method per opcode,
each reading its argument bytes and charging the memory it takes (:mod:`stagesafe.zero.pickle_limits`). Globals
are looked up in fixed tables (:mod:`stagesafe.zero.pickle_globals`, :mod:`stagesafe.zero.pickle_user_values`) or
judged by :mod:`stagesafe.zero.pickle_policy`; nothing a pickle names is imported or called. What it refuses, and
the errors a caller sees, are the reader's (:func:`stagesafe.zero.pickle_reader.read_pickle`)."""

from __future__ import annotations

import _compat_pickle
import re
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from stagesafe.errors import shown
from stagesafe.zero.pickle_globals import (
    Malformed,
    NamedGlobal,
    OpaqueRecord,
    Pending,
    Refused,
    Rule,
    StorageRef,
    StorageType,
    count,
    find_global,
    instance_attributes,
    plain_key,
    set_state,
)
from stagesafe.zero.pickle_limits import (
    MARK_LIST,
    MEMORY_PER_BYTE,
    OPCODE_MEMORY,
    PER_ITEM,
    RESULT,
    SPARSE_SLOT,
    HashSpread,
    OverLimit,
    weight,
)
from stagesafe.zero.pickle_policy import outside_table
from stagesafe.zero.pickle_user_values import ATTRIBUTE_TARGETS, USER_VALUE_GLOBALS

__all__ = ["Interpreter", "OutsideSubset"]

_MAX_NAME = 256  # characters of a global's module or name
_MAX_LONG = 64  # bytes of an integer (LONG1, LONG4): DeepSpeed's are 8 at most; larger ones cost time to hash
_PROTOCOL = 5
_STORAGE_KEY = re.compile(r"[0-9]{1,20}")  # torch.save names storage records data/0, data/1, ...
_CALLED = " (a function, called)"  # why a name outside the tables is refused, beside being in a denied module


class OutsideSubset(Exception):
    """An opcode outside the subset: ``(code, position)``."""


class _Stop(Exception):
    pass


class Interpreter:
    """The state of one pickle's interpretation, as in ``pickle._Unpickler``: a stack, marks saving the stacks
    under them, the memo. Each opcode method reads its argument bytes and changes the state."""

    def __init__(self, data: bytes, *, trusted: bool, memory_base: int):
        self.data = memoryview(data)
        self.pos = 0
        self.at = 0  # where the opcode being interpreted starts
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: list[Any] = []  # slots 0, 1, 2... as pickle numbers them
        self.sparse_memo: dict[int, Any] = {}  # slots set before those below them
        self.proto = 0  # until a PROTO opcode says
        self.storages: dict[str, StorageRef] = {}
        self.trusted = trusted
        self.refused: dict[str, str] = {}  # name -> why ("" or _CALLED), in the order named
        self.stand_ins: dict[str, str] = {}  # names of the stand-ins built, in order -> ""
        self.names: dict[str, Any] = {}  # what each name outside the tables stands for: one object per name
        self.pending_slots: dict[int, list[int]] = {}  # id of a Pending value -> the memo slots holding it
        self.spread = HashSpread()
        self.memory_base = memory_base  # bytes charged on top of those per byte (pickle_limits.MEMORY_BASE)
        self.budget = MEMORY_PER_BYTE * len(data) + memory_base
        self.left = self.budget  # bytes of memory still to be charged (pickle_limits)

    def run(self) -> Any:
        data, ops, costs = self.data, _OPS, _COSTS
        end = len(data)
        try:
            while True:
                if self.pos >= end:
                    raise Malformed("it ends before its STOP opcode (truncated?)")
                self.at = self.pos
                code = data[self.pos]
                self.pos += 1
                op = ops.get(code)
                if op is None:
                    raise OutsideSubset(code, self.at)
                op(self)
                self.left -= costs[code]
                if self.left < 0:
                    self.spend(0)
        except _Stop:
            return self.stack.pop()

    def spend(self, nbytes: int) -> None:
        """Charge ``nbytes`` of memory (or work: items touched) to the budget."""
        self.left -= nbytes
        if self.left < 0:
            raise OverLimit(
                f"reading its pickle of {len(self.data)} bytes would take more than {self.budget // 2**20} MiB of "
                f"memory ({MEMORY_PER_BYTE} bytes per byte of pickle and {self.memory_base // 2**20} MiB), as no file "
                "torch.save writes does: it was crafted to exhaust memory or time"
            )

    def note(self, value: Any) -> None:
        """Remember a stand-in for the warning."""
        if type(value) is OpaqueRecord and not value._known and not self.trusted:
            self.stand_ins[value._stands_for] = ""

    # -- reading arguments
    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise Malformed(f"an argument of {n} bytes runs past its end (truncated?)")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: struct.Struct) -> Any:
        return fmt.unpack(self.take(fmt.size))[0]

    def line(self) -> str:
        end = bytes(self.data[self.pos : self.pos + _MAX_NAME + 1]).find(b"\n")
        if end < 0:
            raise Malformed(f"a GLOBAL name longer than {_MAX_NAME} characters, or cut off")
        text = bytes(self.take(end + 1)[:-1])
        return text.decode("utf-8")

    # -- the stack
    def push(self, value: Any) -> None:
        self.stack.append(value)

    def pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise Malformed("an opcode takes the items since a MARK, and there is none")
        items, self.stack = self.stack, self.metastack.pop()
        self.left += MARK_LIST  # the caller makes the items a tuple or adds them to a container, freeing the list
        return items

    def top(self) -> Any:
        if not self.stack:
            raise Malformed("an opcode needs a value and the stack is empty")
        return self.stack[-1]

    def pop(self) -> Any:
        value = self.top()
        self.stack.pop()
        return value

    # -- opcodes: structure
    def op_proto(self) -> None:
        self.proto = self.unpack(_B)
        if self.proto > _PROTOCOL:
            raise Malformed(f"pickle protocol {self.proto}")

    def op_frame(self) -> None:
        self.take(8)  # a length hint for buffered reading: the data is all here

    def op_stop(self) -> None:
        self.top()
        raise _Stop

    def op_mark(self) -> None:
        self.metastack.append(self.stack)
        self.stack = []

    def op_pop(self) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self.pop_mark()

    def op_pop_mark(self) -> None:
        self.pop_mark()

    def op_dup(self) -> None:
        self.push(self.top())

    # -- opcodes: scalars
    def op_none(self) -> None:
        self.push(None)

    def op_true(self) -> None:
        self.push(True)

    def op_false(self) -> None:
        self.push(False)

    def op_binint(self) -> None:
        self.push(self.unpack(_I4))

    def op_binint1(self) -> None:
        self.push(self.unpack(_B))

    def op_binint2(self) -> None:
        self.push(self.unpack(_U2))

    def op_long1(self) -> None:
        self.push(self.long(self.unpack(_B)))

    def op_long4(self) -> None:
        self.push(self.long(self.unpack(_I4)))

    def long(self, n: int) -> int:
        if not 0 <= n <= _MAX_LONG:
            raise Malformed(f"an integer of {n} bytes (at most {_MAX_LONG} are read)")
        return int.from_bytes(self.take(n), "little", signed=True)

    def op_binfloat(self) -> None:
        self.push(self.unpack(_F8))

    def op_binunicode(self) -> None:
        self.push(self.text(self.unpack(_U4)))

    def op_short_binunicode(self) -> None:
        self.push(self.text(self.unpack(_B)))

    def op_binunicode8(self) -> None:
        self.push(self.text(self.unpack(_U8)))

    def text(self, n: int) -> str:
        value = str(self.take(n), "utf-8", "surrogatepass")  # as pickle reads them: a lone surrogate is kept
        self.spend(sys.getsizeof(value))
        return value

    def op_binbytes(self) -> None:
        self.push(self.bytes(bytes, self.unpack(_U4)))

    def op_short_binbytes(self) -> None:
        self.push(self.bytes(bytes, self.unpack(_B)))

    def op_binbytes8(self) -> None:
        self.push(self.bytes(bytes, self.unpack(_U8)))

    def op_bytearray8(self) -> None:
        self.push(self.bytes(bytearray, self.unpack(_U8)))

    def bytes(self, kind: type, n: int) -> Any:
        value = kind(self.take(n))
        self.spend(sys.getsizeof(value))
        return value

    # -- opcodes: containers
    def op_empty_tuple(self) -> None:
        self.push(())

    def op_tuple(self) -> None:
        items = self.pop_mark()
        self.spend(PER_ITEM["tuple"] * len(items))
        self.push(tuple(items))

    def op_tuple1(self) -> None:
        self.push((self.pop(),))

    def op_tuple2(self) -> None:
        second = self.pop()
        self.push((self.pop(), second))

    def op_tuple3(self) -> None:
        third, second = self.pop(), self.pop()
        self.push((self.pop(), second, third))

    def op_empty_list(self) -> None:
        self.push([])

    def op_append(self) -> None:
        value = self.pop()
        self.container(list).append(value)

    def op_appends(self) -> None:
        items = self.pop_mark()
        self.spend(PER_ITEM["list"] * len(items))
        self.container(list).extend(items)

    def op_empty_dict(self) -> None:
        self.push({})

    def op_setitem(self) -> None:
        value, name = self.pop(), self.pop()
        target = self.container(dict)
        target[self.key(target, name)] = value

    def op_setitems(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise Malformed("SETITEMS of an odd number of items")
        self.spend(PER_ITEM["dict"] * len(items) // 2)
        target = self.container(dict)
        for i in range(0, len(items), 2):
            target[self.key(target, items[i])] = items[i + 1]

    def op_empty_set(self) -> None:
        self.push(set())

    def op_additems(self) -> None:
        items = self.pop_mark()
        self.spend(PER_ITEM["set"] * len(items))
        target = self.container(set)
        target.update(self.key(target, item) for item in items)

    def op_frozenset(self) -> None:
        items = self.pop_mark()
        self.spend(PER_ITEM["set"] * len(items))
        self.push(frozenset(self.key(items, item) for item in items))

    def key(self, owner: Any, value: Any) -> Any:
        """``value`` as a key of ``owner``: a plain value, few of them of one hash (pickle_limits)."""
        value = plain_key(value)
        self.spend(self.spread.check(owner, value))
        return value

    def container(self, kind: type) -> Any:
        """The container on top of the stack, which items are added to: a ``kind`` (a dict may be ordered), or
        the items of a stand-in (a list or dict subclass of the user's)."""
        target = self.top()
        if isinstance(target, Refused):
            return _SINK
        if type(target) is kind or (kind is dict and type(target) is OrderedDict):
            return target
        if type(target) is OpaqueRecord and kind is not set and not target._known:
            if target._items is None:
                target._items = kind()
            if type(target._items) is kind:
                return target._items
        raise Malformed(f"an opcode adds items to {shown(target, 60)}, which is not a {kind.__name__}")

    # -- opcodes: the memo
    def op_binput(self) -> None:
        self.put(self.unpack(_B))

    def op_long_binput(self) -> None:
        self.put(self.unpack(_U4))

    def op_memoize(self) -> None:
        self.put(len(self.memo) + len(self.sparse_memo))

    def put(self, index: int) -> None:
        value = self.top()
        self.memo_set(index, value)
        if isinstance(value, Pending):  # its BUILD replaces it here too
            self.pending_slots.setdefault(id(value), []).append(index)

    def memo_set(self, index: int, value: Any) -> None:
        """Pickles number their memo slots 0, 1, 2...: those are a list (8 bytes a slot); others a dict."""
        memo = self.memo
        if index == len(memo):
            memo.append(value)
        elif index < len(memo):
            memo[index] = value
        else:
            self.spend(SPARSE_SLOT)
            self.sparse_memo[index] = value

    def memo_get(self, index: int) -> Any:
        if index < len(self.memo):
            return self.memo[index]
        if index not in self.sparse_memo:
            raise Malformed(f"memo slot {index} is read but was never set")
        return self.sparse_memo[index]

    def op_binget(self) -> None:
        self.get(self.unpack(_B))

    def op_long_binget(self) -> None:
        self.get(self.unpack(_U4))

    def get(self, index: int) -> None:
        self.push(self.memo_get(index))

    # -- opcodes: globals and what is built from them
    def op_global(self) -> None:
        module = self.line()
        self.push(self.lookup(module, self.line()))

    def op_stack_global(self) -> None:
        name, module = self.pop(), self.pop()
        if type(name) is not str or type(module) is not str or len(name) > _MAX_NAME or len(module) > _MAX_NAME:
            raise Malformed(f"STACK_GLOBAL of {shown(module, 60)}, {shown(name, 60)}")
        self.push(self.lookup(module, name))

    def lookup(self, module: str, name: str) -> Any:
        if self.proto < 3:  # protocol 2 writes Python 2's names (__builtin__.set): read them as pickle does
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            else:
                module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        found = find_global(full)
        if found is None:
            found = USER_VALUE_GLOBALS.get(full)
        if found is None:
            found = self.names.get(full)
        if found is None:
            self.spend(RESULT)
            found = outside_table(module, name)
            if isinstance(found, Refused) and self.trusted:
                found = NamedGlobal(full, class_like=True)
            if isinstance(found, Refused):
                self.refused.setdefault(full, "")
            elif not self.trusted and full != "builtins.object":  # that one: copyreg._reconstructor's base
                self.stand_ins[full] = ""
            self.names[full] = found
        return found

    def op_reduce(self) -> None:
        args = self.pop()
        func = self.top()
        self.stack[-1] = self.apply(func, args, "call")

    def op_newobj(self) -> None:
        args = self.pop()
        self.push(self.apply(self.pop(), args, "new"))

    def op_newobj_ex(self) -> None:
        kwargs, args = self.pop(), self.pop()
        if kwargs != {} and not isinstance(kwargs, Refused):
            raise Malformed(f"NEWOBJ_EX with keyword arguments {shown(kwargs, 60)}")
        self.push(self.apply(self.pop(), args, "new"))

    def apply(self, func: Any, args: Any, how: str) -> Any:
        """``func(*args)`` (``how`` "call": REDUCE) or ``func.__new__(func, *args)`` ("new": NEWOBJ), as the
        table's rule for ``func`` builds it, or a stand-in of a class outside the tables; never a call of what the
        pickle names."""
        if isinstance(func, Refused):
            return func
        if type(args) is not tuple:
            raise Malformed(f"{shown(func, 60)} applied to {shown(args, 60)}, which is not a tuple")
        self.spend(weight(args))
        if isinstance(func, Rule) and getattr(func, how) is not None:
            built = getattr(func, how)(args)
            self.note(built)
            return built
        if isinstance(func, NamedGlobal) and (how == "new" or func.class_like or self.trusted):
            return OpaqueRecord(func._stands_for, args)
        if isinstance(func, OpaqueRecord):  # a function outside the tables, or an object, called: refused
            named = func._stands_for if isinstance(func, NamedGlobal) else f"an object of {func._stands_for}"
            if self.trusted:
                return OpaqueRecord(func._stands_for, args)
            self.refused.setdefault(named, _CALLED)
            return Refused(named)
        what = "called" if how == "call" else "instantiated"
        raise Malformed(f"{shown(func, 60)} is {what}, which this reader does not do for it")

    def op_build(self) -> None:
        state = self.pop()
        target = self.top()
        self.spend(weight((state,)))
        if isinstance(target, Refused):
            return
        if isinstance(target, Pending):
            built = self.stack[-1] = target.build(state)
            for slot in self.pending_slots.pop(id(target), ()):
                if self.memo_get(slot) is target:
                    self.memo_set(slot, built)
            self.note(built)
        elif type(target) is OpaqueRecord:
            set_state(target, state)
        elif type(target) is OrderedDict:  # a state dict's _metadata, say
            target.__dict__.update(instance_attributes(state))
        elif type(target) in ATTRIBUTE_TARGETS:
            ATTRIBUTE_TARGETS[type(target)](target, state)
        else:
            raise Malformed(f"BUILD of {shown(target, 60)} with the state {shown(state, 60)}")

    def op_binpersid(self) -> None:
        self.push(self.storage(self.pop()))

    def storage(self, pid: Any) -> StorageRef | Refused:
        """``('storage', storage type, key, location, numel)``, as ``torch.save`` names a storage; one key names
        one storage, of one type and size."""
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise Malformed(f"the persistent id {shown(pid, 60)} is not a storage of torch.save's")
        _, kind, name, location, numel = pid
        if isinstance(kind, Refused):
            return kind
        if not isinstance(kind, StorageType) or type(name) is not str or not _STORAGE_KEY.fullmatch(name):
            raise Malformed(f"the storage {shown(pid, 60)} is not of a known type and key")
        if type(location) is not str or len(location) > 64:
            raise Malformed(f"the storage location {shown(location, 60)}")
        ref = StorageRef(name, kind.dtype, count(numel, "a storage's size"))
        if name not in self.storages:
            self.spend(RESULT)  # a storage reference: 120 bytes
        known = self.storages.setdefault(name, ref)
        if known != ref:
            raise Malformed(f"storage {name} is named as {known.numel} {known.dtype} and as {numel} {kind.dtype}")
        return known


class _Sink:
    """Where items go that are added to a container built from a refused global: nowhere."""

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def update(self, values: Any) -> None:
        for _ in values:
            pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


_SINK = _Sink()


_B, _U2, _I4, _U4, _U8, _F8 = (struct.Struct(f) for f in ("<B", "<H", "<i", "<I", "<Q", ">d"))
_OPS: dict[int, Callable[[Interpreter], None]] = {
    ord(code): getattr(Interpreter, f"op_{name}")
    for code, name in {
        b"\x80": "proto", b"\x95": "frame", b".": "stop", b"(": "mark", b"0": "pop", b"1": "pop_mark", b"2": "dup",
        b"N": "none", b"\x88": "true", b"\x89": "false", b"J": "binint", b"K": "binint1", b"M": "binint2",
        b"\x8a": "long1", b"\x8b": "long4", b"G": "binfloat", b"X": "binunicode", b"\x8c": "short_binunicode",
        b"\x8d": "binunicode8", b"B": "binbytes", b"C": "short_binbytes", b"\x8e": "binbytes8",
        b"\x96": "bytearray8", b")": "empty_tuple", b"t": "tuple", b"\x85": "tuple1", b"\x86": "tuple2",
        b"\x87": "tuple3", b"]": "empty_list", b"a": "append", b"e": "appends", b"}": "empty_dict", b"s": "setitem",
        b"u": "setitems", b"\x8f": "empty_set", b"\x90": "additems", b"\x91": "frozenset", b"q": "binput",
        b"r": "long_binput", b"\x94": "memoize", b"h": "binget", b"j": "long_binget", b"c": "global",
        b"\x93": "stack_global", b"R": "reduce", b"\x81": "newobj", b"\x92": "newobj_ex", b"b": "build",
        b"Q": "binpersid",
    }.items()
}  # fmt: skip

_COSTS = [0] * 256
for _code, _nbytes in OPCODE_MEMORY.items():
    _COSTS[_code[0]] = _nbytes
