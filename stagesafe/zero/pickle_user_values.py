"""The values Lightning users put in hyperparameters and callbacks' state, built from a pickle by this module's
constructors with their arguments checked, never by calling what the file names: ``pathlib`` paths, numpy
scalars, dtypes and arrays (from the pickle's own bytes), ``datetime`` values and ``argparse.Namespace``; and
``copyreg._reconstructor``, how pickle protocols 0 and 1 instantiate a class (:mod:`.pickle_policy`).

Each name maps to a :class:`~stagesafe.zero.pickle_globals.Rule`, as in the table of torch's and DeepSpeed's
globals, under every name CPython and numpy have pickled it by (``pathlib.PosixPath`` and Python 3.13's
``pathlib._local.PosixPath``; ``numpy.core.multiarray`` and numpy 2's ``numpy._core.multiarray``). A value of a
kind built here but not exactly (an array of Python objects, a datetime whose tzinfo is not a fixed offset)
becomes an inert :class:`~stagesafe.zero.pickle_globals.OpaqueRecord`, which the reader warns about. numpy is
imported when a file names it.
"""

from __future__ import annotations

import argparse
import datetime
import math
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

from stagesafe.errors import shown
from stagesafe.zero.pickle_globals import Malformed, OpaqueRecord, Pending, Refused, Rule, count, instance_attributes
from stagesafe.zero.pickle_policy import RECONSTRUCTOR

__all__ = ["ATTRIBUTE_TARGETS", "USER_VALUE_GLOBALS"]

_MAX_DIMS = 64
# numpy dtypes built exactly (bool, integers, floats, complex, fixed-width text and bytes), as numpy pickles
# their names; others (objects, records, datetime64, void) become stand-ins.
_NUMPY_DESCR = re.compile(r"b1|[iu][1248]|f(2|4|8|16)|c(8|16|32)|[US][0-9]{1,9}")


# -- pathlib ---------------------------------------------------------------------------------------------------


def _path(kind: type) -> Callable[[tuple], Any]:
    """``PosixPath(*parts)``, as paths pickle: their parts, each a str. A concrete path of another system's
    flavour (a WindowsPath on Linux) is built as the pure path of that flavour, as it cannot be instantiated."""

    def build(args: tuple) -> Any:
        if not all(type(part) is str for part in args):
            raise Malformed(f"a path of the parts {shown(args, 60)}, which are not all str")
        return kind(*args)

    return build


_CONCRETE = {"PosixPath": pathlib.PurePosixPath, "WindowsPath": pathlib.PureWindowsPath}
_CONCRETE[type(pathlib.Path()).__name__] = type(pathlib.Path())
_PATHS = {
    **_CONCRETE,
    "Path": pathlib.Path,
    "PurePath": pathlib.PurePath,
    "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}


# -- numpy -----------------------------------------------------------------------------------------------------


class _NdarrayType:
    """``numpy.ndarray`` as a value: the class ``_reconstruct`` is given."""


_NDARRAY = _NdarrayType()


def _numpy_dtype(value: Any) -> bool:
    """``value`` is a numpy dtype (this module built it: numpy is imported only then)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.dtype)


def _dtype(args: tuple) -> Pending:
    """``numpy.dtype(name, align, copy)``; its ``BUILD`` gives the byte order."""
    if len(args) != 3 or type(args[0]) is not str or type(args[1]) is not bool or type(args[2]) is not bool:
        raise Malformed(f"numpy.dtype{shown(args, 60)}")
    return _PendingDType(args[0])


class _PendingDType(Pending):
    def __init__(self, name: str):
        self.name = name

    def build(self, state: Any) -> Any:
        """The dtype whose pickled state is ``state``: one of the two numpy writes for the name (native or swapped
        byte order), never a state numpy's own ``__setstate__`` would be trusted with."""
        if not _NUMPY_DESCR.fullmatch(self.name):
            record = OpaqueRecord("numpy.dtype", (self.name,))
            record._state = state
            return record
        import numpy

        native = numpy.dtype(self.name)
        for dtype in (native, native.newbyteorder()):
            if type(state) is tuple and len(state) == 8 and state == dtype.__reduce__()[2]:
                return dtype
        raise Malformed(f"a numpy dtype {self.name!r} with the state {shown(state, 60)}, which numpy does not write")

    def __repr__(self) -> str:
        return f"<numpy dtype {self.name!r} before its BUILD>"


def _scalar(args: tuple) -> Any:
    """``numpy.core.multiarray.scalar(dtype, bytes)``: a numpy scalar of ``dtype`` from its bytes."""
    if len(args) != 2:
        raise Malformed(f"a numpy scalar of {len(args)} arguments")
    dtype, data = args
    if isinstance(dtype, Refused):
        return dtype
    if isinstance(dtype, OpaqueRecord):
        return OpaqueRecord("numpy.generic", args)
    if not _numpy_dtype(dtype) or dtype.hasobject or type(data) is not bytes or len(data) != dtype.itemsize:
        raise Malformed(f"a numpy scalar of {shown(dtype, 40)} from {shown(data, 40)}")
    import numpy

    return numpy.frombuffer(data, dtype=dtype, count=1)[0]


def _reconstruct(args: tuple) -> Pending:
    """``numpy.core.multiarray._reconstruct(ndarray, (0,), b"b")``, an empty array its ``BUILD`` fills."""
    if len(args) != 3 or args[0] is not _NDARRAY or args[1] != (0,) or type(args[2]) is not bytes:
        raise Malformed(f"numpy's _reconstruct{shown(args, 60)}")
    return _PendingArray()


class _PendingArray(Pending):
    def build(self, state: Any) -> Any:
        """``(1, shape, dtype, fortran order, raw bytes)``: an array of those bytes, which must be exactly
        ``prod(shape) * itemsize``. An array of another dtype (Python objects: its state holds a list) is a
        stand-in."""
        if type(state) is not tuple or len(state) != 5 or type(state[0]) is not int or type(state[3]) is not bool:
            raise Malformed(f"a numpy array's state {shown(state, 60)}, not (version, shape, dtype, order, bytes)")
        version, shape, dtype, fortran, raw = state
        if type(shape) is not tuple or len(shape) > _MAX_DIMS or version != 1:
            raise Malformed(f"a numpy array of version {version} and shape {shown(shape, 60)}")
        shape = tuple(count(size, "a numpy array's size") for size in shape)
        if not _numpy_dtype(dtype) or dtype.hasobject or type(raw) not in (bytes, bytearray):
            record = OpaqueRecord("numpy.ndarray")
            record._state = state
            return record
        elements = math.prod(shape)
        if elements > max(len(raw), 1):  # numpy makes zero-size items one byte or more (U0 is U1): never written
            raise Malformed(
                f"a numpy array of shape {list(shape)[:8]} ({elements} elements) from {len(raw)} bytes: an array's "
                "element count is checked apart from its bytes, and is never more than its bytes"
            )
        if elements * dtype.itemsize != len(raw):
            raise Malformed(f"a numpy array of shape {list(shape)[:8]} and dtype {dtype} from {len(raw)} bytes")
        import numpy

        if not dtype.itemsize:
            return numpy.empty(shape, dtype=dtype)
        # A copy of its own, writable, as numpy's unpickling makes: the BUILD was charged its bytes (weight)
        return numpy.frombuffer(bytearray(raw), dtype=dtype).reshape(shape, order="F" if fortran else "C")

    def __repr__(self) -> str:
        return "<numpy array before its BUILD>"


# -- datetime --------------------------------------------------------------------------------------------------


def _moment(kind: type, size: int) -> Callable[[tuple], Any]:
    """``date(state)``, ``datetime(state[, tzinfo])``, ``time(state[, tzinfo])``: the pickled state is ``size``
    bytes, which the constructor checks; a tzinfo other than a fixed offset makes it a stand-in."""
    most = 1 if kind is datetime.date else 2

    def build(args: tuple) -> Any:
        if not 1 <= len(args) <= most or type(args[0]) is not bytes or len(args[0]) != size:
            raise Malformed(f"datetime.{kind.__name__}{shown(args, 60)}")
        if len(args) == 2 and args[1] is not None and type(args[1]) is not datetime.timezone:
            return OpaqueRecord(f"datetime.{kind.__name__}", args)
        return kind(*args)

    return build


def _timedelta(args: tuple) -> datetime.timedelta:
    if len(args) != 3 or not all(type(part) is int for part in args):
        raise Malformed(f"datetime.timedelta{shown(args, 60)}")
    return datetime.timedelta(*args)


def _timezone(args: tuple) -> datetime.timezone:
    named = len(args) == 2 and type(args[1]) is str
    if not (len(args) == 1 or named) or type(args[0]) is not datetime.timedelta:
        raise Malformed(f"datetime.timezone{shown(args, 60)}")
    return datetime.timezone(*args)


# -- argparse ------------------------------------------------------------------------------------------------------


def _namespace(args: tuple) -> argparse.Namespace:
    """``argparse.Namespace()``; its ``BUILD`` gives the attributes."""
    if args != ():
        raise Malformed(f"argparse.Namespace{shown(args, 60)}")
    return argparse.Namespace()


def _set_attributes(target: Any, state: Any) -> None:
    vars(target).update(instance_attributes(state))


# Types whose BUILD sets attributes, as pickle's does: target -> state -> None.
ATTRIBUTE_TARGETS: dict[type, Callable[[Any, Any], None]] = {argparse.Namespace: _set_attributes}

USER_VALUE_GLOBALS: dict[str, Any] = {
    **{
        f"{module}.{name}": Rule(f"{module}.{name}", call=_path(kind))
        for module in ("pathlib", "pathlib._local")
        for name, kind in _PATHS.items()
    },
    "numpy.dtype": Rule("numpy.dtype", call=_dtype),
    "numpy.ndarray": _NDARRAY,
    **{
        f"{module}.{name}": Rule(f"{module}.{name}", call=build)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray")
        for name, build in (("scalar", _scalar), ("_reconstruct", _reconstruct))
    },
    "datetime.date": Rule("datetime.date", call=_moment(datetime.date, 4)),
    "datetime.datetime": Rule("datetime.datetime", call=_moment(datetime.datetime, 10)),
    "datetime.time": Rule("datetime.time", call=_moment(datetime.time, 6)),
    "datetime.timedelta": Rule("datetime.timedelta", call=_timedelta),
    "datetime.timezone": Rule("datetime.timezone", call=_timezone),
    "argparse.Namespace": Rule("argparse.Namespace", call=_namespace, new=_namespace),
    "copyreg._reconstructor": RECONSTRUCTOR,
}
