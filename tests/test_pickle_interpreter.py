"""zero/pickle_interpreter.py: one pickle interpreted without running it: plain data comes back as ``pickle``
gives it, at every binary protocol (the text protocols' opcodes are outside the subset); a pickle cut short is refused as malformed; a name outside the tables is not
called."""

from __future__ import annotations

import pickle

import pytest

from stagesafe.zero.pickle_globals import Malformed
from stagesafe.zero.pickle_interpreter import Interpreter, OutsideSubset
from stagesafe.zero.pickle_limits import MEMORY_BASE

_PLAIN = {"step": 3, "lr": 0.1, "betas": (0.9, 0.999), "names": ["a", "b"], "none": None, "flag": True,
          "bytes": b"\x00\x01", "nested": {"x": [1, 2.5, {"y": "z"}]}}


def _run(data: bytes):
    return Interpreter(data, trusted=False, memory_base=MEMORY_BASE).run()


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_comes_back_as_pickle_gives_it(protocol):
    assert _run(pickle.dumps(_PLAIN, protocol=protocol)) == pickle.loads(pickle.dumps(_PLAIN, protocol=protocol))


@pytest.mark.parametrize("protocol", [0, 1])
def test_the_text_protocols_opcodes_are_outside_the_subset(protocol):
    with pytest.raises(OutsideSubset):
        _run(pickle.dumps(_PLAIN, protocol=protocol))


def test_a_pickle_cut_short_is_malformed():
    data = pickle.dumps(_PLAIN, protocol=2)
    with pytest.raises(Malformed, match="STOP|truncated"):
        _run(data[:-1])


def test_a_name_outside_the_tables_is_not_called(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Payload(str(marker)), protocol=2)
    try:
        _run(payload)
    except Exception:  # refused: what matters is that it did not run  # noqa: BLE001
        pass
    assert not marker.exists()


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
