"""The line between a stand-in and a refusal for names outside the reader's tables (stagesafe/zero/pickle_policy.py),
and the proof that neither runs anything: payloads that are live under Python's own pickle (they create a file)
never create it here."""

from __future__ import annotations

import gzip
import os
import pickle
import zipfile

import pytest
import torch
from _hostile import torch_save_pickle

from stagesafe.errors import UnsafeCheckpointError
from stagesafe.zero.pickle_globals import NamedGlobal, OpaqueRecord
from stagesafe.zero.pickle_policy import outside_table
from stagesafe.zero.pickle_reader import read_pickle

pytestmark = pytest.mark.timeout(60)

DISPLAY = "ckpt/zero_pp_rank_0_mp_rank_00_model_states.pt"


class WritesWhenBuilt:
    """A user's class whose constructor has an effect: creates the file it is given."""

    def __init__(self, path: str):
        with open(path, "w"):
            pass


class Reduces:
    """A user's object whose ``__reduce__`` names any callable with any arguments."""

    def __init__(self, func, *args):
        self.reduced = (func, args)

    def __reduce__(self):
        return self.reduced


# Payloads: each creates ``marker`` when Python's pickle loads it. -> what stagesafe's reader makes of it.
PAYLOADS = {
    "os.system": (lambda m: Reduces(os.system, f"touch {m}"), "refused"),
    "subprocess.run": (lambda m: Reduces(__import__("subprocess").run, ["touch", m]), "refused"),
    "builtins.exec": (lambda m: Reduces(exec, f"open({m!r}, 'w').close()"), "refused"),
    "builtins.open": (lambda m: Reduces(open, m, "w"), "refused"),
    "gzip.open (a function outside the list)": (lambda m: Reduces(gzip.open, m, "w"), "refused"),
    "zipfile.ZipFile (a class outside the list)": (lambda m: Reduces(zipfile.ZipFile, m, "w"), "stand-in"),
    "a user's class whose constructor writes": (lambda m: Reduces(WritesWhenBuilt, m), "stand-in"),
}


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_a_pickle_asking_to_call_anything_runs_nothing_and_is_refused_unless_it_names_a_class(tmp_path, name):
    make, outcome = PAYLOADS[name]
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(make(str(live)), protocol=2))
    assert live.exists()  # the payload is live under Python's pickle
    marker = tmp_path / "marker"
    data = torch_save_pickle({"hyper_parameters": {"x": make(str(marker))}, "w": torch.ones(2)})
    if outcome == "refused":
        with pytest.raises(UnsafeCheckpointError, match="nothing from the file was executed"):
            read_pickle(data, display=DISPLAY)
    else:
        value = read_pickle(data, display=DISPLAY)["hyper_parameters"]["x"]
        assert isinstance(value, OpaqueRecord) and value._args[0] == str(marker)
    assert not marker.exists()


def test_a_call_of_a_function_outside_the_list_is_named_as_a_call():
    data = torch_save_pickle({"x": Reduces(gzip.open, "f", "w")})
    with pytest.raises(UnsafeCheckpointError, match=r"the global 'gzip.open' \(a function, called\)"):
        read_pickle(data, display=DISPLAY)


def test_calling_a_stand_in_object_is_refused():
    """A stand-in built from a class, then called (REDUCE on it): under pickle, its class's ``__call__`` would run."""
    data = b"\x80\x02cmypkg\nThing\n)\x81)R."
    with pytest.raises(UnsafeCheckpointError, match=r"'an object of mypkg.Thing' \(a function, called\)"):
        read_pickle(data, display=DISPLAY)


@pytest.mark.parametrize(
    "module,name",
    [("os", "system"), ("posix", "system"), ("nt", "system"), ("subprocess", "Popen"), ("builtins", "eval"),
     ("builtins", "getattr"), ("builtins", "__import__"), ("importlib", "import_module"), ("sys", "modules"),
     ("shutil", "rmtree"), ("socket", "socket"), ("pickle", "loads"), ("marshal", "loads"), ("runpy", "run_path"),
     ("code", "InteractiveInterpreter"), ("ctypes", "CDLL"), ("os.path", "join"), ("importlib.util", "find_spec"),
     ("multiprocessing.util", "spawnv_passfds"), ("functools", "partial"), ("operator", "attrgetter")],
)  # fmt: skip
def test_names_of_modules_that_run_code_are_refused_even_as_values(module, name):
    assert not isinstance(outside_table(module, name), NamedGlobal)
    data = f"\x80\x02]c{module}\n{name}\na.".encode("latin1")  # the global in a list: never called
    with pytest.raises(UnsafeCheckpointError, match=rf"the global '{module}.{name}'"):
        read_pickle(data, display=DISPLAY)


@pytest.mark.parametrize(
    "module,name,class_like",
    [("mypkg.config", "Config", True), ("__main__", "_Private", True), ("torch.nn.modules.linear", "Linear", True),
     ("typing", "Any", True), ("builtins", "dict", False), ("mypkg", "make_model", False), ("enum", "auto", False)],
)  # fmt: skip
def test_other_names_are_stand_ins_as_values_and_classes_only_may_be_called(module, name, class_like):
    found = outside_table(module, name)
    assert isinstance(found, NamedGlobal) and found.class_like == class_like
    value = read_pickle(f"\x80\x02]c{module}\n{name}\na.".encode("latin1"), display=DISPLAY)[0]
    assert isinstance(value, NamedGlobal) and value._stands_for == f"{module}.{name}"
    called = f"\x80\x02c{module}\n{name}\nK\x01\x85R.".encode("latin1")
    if class_like:
        assert read_pickle(called, display=DISPLAY)._args == (1,)
    else:
        with pytest.raises(UnsafeCheckpointError, match="a function, called"):
            read_pickle(called, display=DISPLAY)
    instantiated = read_pickle(f"\x80\x02c{module}\n{name}\n)\x81.".encode("latin1"), display=DISPLAY)
    assert type(instantiated) is OpaqueRecord  # NEWOBJ instantiates a class, whatever its name
