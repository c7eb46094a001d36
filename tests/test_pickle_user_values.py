"""The values users keep in hyperparameters and callbacks' state (stagesafe/zero/pickle_user_values.py), read from
the pickles torch.save writes of them: paths, numpy values, datetimes, namespaces as themselves; objects of the
user's own classes (Enum members, dataclasses) as inert stand-ins, named in a warning."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import io
import logging
import pathlib
import pickle

import numpy as np
import pytest
import torch
from _hostile import torch_save_pickle

from stagesafe.errors import CheckpointFormatError
from stagesafe.zero.pickle_globals import NamedGlobal, OpaqueRecord
from stagesafe.zero.pickle_reader import read_pickle

pytestmark = pytest.mark.timeout(60)

DISPLAY = "ckpt/zero_pp_rank_0_mp_rank_00_model_states.pt"


def read(data: bytes):
    return read_pickle(data, display=DISPLAY)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1


@dataclasses.dataclass
class Config:
    lr: float = 0.1
    name: str = "adam"
    layers: tuple = (4, 2)


@dataclasses.dataclass(frozen=True)
class Frozen:
    depth: int = 3


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self):
        self.a, self.b = 1, [2]


class Bag(dict):
    """A user's dict subclass: its items are pickled with SETITEMS."""


# -- built exactly -----------------------------------------------------------------------------------------------


def test_paths_read_as_the_paths_torch_save_pickle():
    paths = [pathlib.Path("/data/run 1/ckpt"), pathlib.PurePosixPath("rel/x"), pathlib.PureWindowsPath("C:/a/b"),
             pathlib.Path("."), pathlib.Path("")]  # fmt: skip
    assert read(torch_save_pickle(paths)) == paths
    assert [type(p) for p in read(torch_save_pickle(paths))] == [type(p) for p in paths]


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])  # Python 3.13 pickles them from pathlib._local
def test_paths_of_every_python_and_system_read_as_this_system_can_hold_them(module):
    def path(cls: str, *parts: str) -> bytes:
        pickled = b"".join(b"X" + len(p).to_bytes(4, "little") + p.encode() for p in parts)
        return f"c{module}\n{cls}\n(".encode() + pickled + b"tR"

    three = path("PosixPath", "/", "a") + path("WindowsPath", "C:\\", "b") + path("PurePath", "c")
    data = b"\x80\x02" + three + b"\x87."
    posix, windows, pure = read(data)
    assert posix == pathlib.PosixPath("/a") and type(posix) is pathlib.PosixPath
    assert windows == pathlib.PureWindowsPath("C:/b")  # a WindowsPath cannot be instantiated on Linux
    assert pure == pathlib.PurePath("c")


NUMPY_VALUES = {
    "f64": np.float64(1.5), "f32": np.float32(-2.25), "f16": np.float16(3.0), "i64": np.int64(-(2**62)),
    "u8": np.uint8(255), "bool": np.bool_(True), "c128": np.complex128(1 + 2j), "str": np.str_("hé"),
    "bytes": np.bytes_(b"ab"), "dtype": np.dtype("float32"), "big_endian": np.dtype(">i4"),
    "matrix": np.arange(6, dtype=np.float32).reshape(2, 3), "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    "scalar_array": np.array(7, dtype=np.int16), "empty": np.zeros((0, 4)), "swapped": np.arange(3, dtype=">f8"),
    "mask": np.array([True, False]), "text": np.array(["ab", "c"]),
}  # fmt: skip


def test_numpy_scalars_dtypes_and_arrays_read_as_the_values_torch_save_pickle():
    values = read(torch_save_pickle(NUMPY_VALUES))
    for name, expected in NUMPY_VALUES.items():
        got = values[name]
        assert type(got) is type(expected), name
        if isinstance(expected, np.ndarray):
            assert got.dtype == expected.dtype and got.shape == expected.shape and np.array_equal(got, expected), name
            assert got.flags.f_contiguous == expected.flags.f_contiguous and got.flags.writeable, name
        else:
            assert got == expected and getattr(got, "dtype", None) == getattr(expected, "dtype", None), name


def test_a_numpy_value_shared_in_the_pickle_stays_one_value():
    array, dtype = np.ones(3), np.dtype(">f4")
    values = read(torch_save_pickle({"a": array, "b": array, "d": dtype, "e": np.array([1, 2], dtype=dtype)}))
    assert values["a"] is values["b"] and values["e"].dtype == values["d"] == dtype


def test_numpy_1_names_read_as_numpy_2_names():
    data = torch_save_pickle([np.float64(0.5), np.arange(2)])
    data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert data.count(b"numpy.core.multiarray") == 2
    scalar, array = read(data)
    assert scalar == 0.5 and np.array_equal(array, np.arange(2))


@pytest.mark.parametrize(
    "old,new,message",
    [
        # the 8 bytes of 1.5 (latin1 text, as protocol 2 pickles bytes), one of them taken away
        (b"X\t\x00\x00\x00" + bytes(6) + b"\xc3\xb8?", b"X\x08\x00\x00\x00" + bytes(5) + b"\xc3\xb8?", "numpy scalar"),
        (b"K\x03\x85", b"K\x04\x85", "numpy array of shape \\[4\\]"),  # 4 elements claimed, 3 given
        (b"(K\x03X\x01\x00\x00\x00<", b"(K\x03X\x01\x00\x00\x00!", "numpy dtype"),  # a byte order numpy never writes
    ],
    ids=["scalar_bytes", "array_bytes", "dtype_state"],
)
def test_numpy_values_whose_bytes_do_not_fit_their_type_are_a_format_error(old, new, message):
    data = torch_save_pickle({"s": np.float64(1.5), "a": np.ones(3)})
    assert old in data
    with pytest.raises(CheckpointFormatError, match=rf"model_states\.pt cannot be read.*{message}"):
        read(data.replace(old, new, 1))


def test_datetimes_read_as_the_values_torch_save_pickle():
    moments = [
        datetime.date(2024, 2, 29), datetime.datetime(2024, 1, 2, 3, 4, 5, 6),
        datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone.utc),
        datetime.datetime(2024, 1, 2, 3, tzinfo=datetime.timezone(datetime.timedelta(hours=-5), "EST")),
        datetime.time(23, 59, 59, 999999), datetime.time(1, tzinfo=datetime.timezone(datetime.timedelta(minutes=30))),
        datetime.timedelta(days=-3, seconds=7, microseconds=9), datetime.timezone.utc,
    ]  # fmt: skip
    got = read(torch_save_pickle(moments))
    assert got == moments and [type(m) for m in got] == [type(m) for m in moments]
    assert got[3].tzname() == "EST"


def test_a_datetime_whose_bytes_are_no_date_is_a_format_error():
    data = torch_save_pickle(datetime.date(2024, 2, 29))
    assert data.count(b"\x07\xc3\xa8\x02\x1d") == 1  # 2024 (0x07e8, latin1 as utf-8), month 2, day 29
    with pytest.raises(CheckpointFormatError, match="cannot be read"):
        read(data.replace(b"\x07\xc3\xa8\x02\x1d", b"\x07\xc3\xa8\x0d\x1d"))  # month 13


def test_an_argparse_namespace_reads_as_a_namespace():
    namespace = argparse.Namespace(lr=0.1, layers=[1, 2], root=pathlib.Path("/x"))
    got = read(torch_save_pickle({"args": namespace}))["args"]
    assert type(got) is argparse.Namespace and got == namespace


# -- stand-ins ---------------------------------------------------------------------------------------------------


def test_objects_of_the_users_classes_are_stand_ins_holding_what_was_pickled(caplog):
    values = {
        "color": Color.BLUE, "level": Level.LOW, "config": Config(), "frozen": Frozen(), "slotted": Slotted(),
        "bag": Bag(a=1), "class": Config, "keyed": {Color.RED: 1},
    }  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="stagesafe.zero.pickle_reader"):
        got = read(torch_save_pickle(values))
    here = __name__
    assert isinstance(got["color"], OpaqueRecord) and got["color"]._stands_for == f"{here}.Color"
    assert got["color"]._args == ("blue",) and got["level"]._args == (1,)
    assert (got["config"].lr, got["config"].name, got["config"].layers) == (0.1, "adam", (4, 2))
    assert got["frozen"].depth == 3 and (got["slotted"].a, got["slotted"].b) == (1, [2])
    assert got["bag"]._items == {"a": 1}
    assert isinstance(got["class"], NamedGlobal) and got["class"]._stands_for == f"{here}.Config"
    (key,) = got["keyed"]
    assert key._stands_for == f"{here}.Color" and key._args == ("red",)  # a stand-in key hashes as itself
    (warning,) = [r.getMessage() for r in caplog.records]
    assert DISPLAY in warning and "inert stand-ins" in warning and "STAGESAFE_TRUST_PICKLES=1" in warning
    for name in ("Color", "Level", "Config", "Frozen", "Slotted", "Bag"):
        assert f"'{here}.{name}'" in warning, name


def test_values_built_inexactly_are_stand_ins_named_in_the_warning(caplog):
    values = {"objects": np.array([1, "a"], dtype=object), "when": np.datetime64("2024-01-01"),
              "record": np.zeros(2, dtype=[("x", "<i4")])}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="stagesafe.zero.pickle_reader"):
        got = read(torch_save_pickle(values))
    assert got["objects"]._stands_for == "numpy.ndarray" and got["objects"]._state[4] == [1, "a"]
    assert got["when"]._stands_for == "numpy.generic" and got["record"]._stands_for == "numpy.ndarray"
    assert "'numpy.ndarray'" in caplog.text and "'numpy.dtype'" in caplog.text


def test_a_users_class_pickled_by_protocol_1_is_a_stand_in():
    data = pickle.dumps({"config": Config(lr=0.5)}, protocol=1)
    assert b"_reconstructor" in data
    assert read(data)["config"].lr == 0.5


def test_a_nested_mix_reads_as_torch_load_gives_it_but_for_the_stand_ins():
    mix = {
        "paths": [pathlib.Path("/a"), {"out": pathlib.PurePosixPath("b")}],
        "numbers": (np.float64(0.25), np.int32(7), [np.arange(4).reshape(2, 2)]),
        "when": {"day": datetime.date(2024, 1, 1), "span": datetime.timedelta(hours=1)},
        "args": argparse.Namespace(seed=np.int64(3), start=datetime.datetime(2020, 5, 4)),
        "w": torch.ones(2),
    }
    data = torch_save_pickle(mix)
    got, theirs = read(data), torch.load(io.BytesIO(_archive(mix)), weights_only=False)
    assert repr({k: v for k, v in got.items() if k != "w"}) == repr({k: v for k, v in theirs.items() if k != "w"})
    assert got["w"].shape == (2,)


def _archive(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_trusted_reading_refuses_nothing_and_warns_of_nothing(tmp_path, caplog):
    import os

    marker = tmp_path / "ran"

    class System:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with caplog.at_level(logging.WARNING, logger="stagesafe.zero.pickle_reader"):
        got = read_pickle(torch_save_pickle({"x": System(), "c": Color.RED}), display=DISPLAY, trusted=True)
    assert isinstance(got["x"], OpaqueRecord) and got["x"]._stands_for == "posix.system"
    assert not marker.exists() and not caplog.records
