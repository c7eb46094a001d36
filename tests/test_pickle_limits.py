"""Bounds on reading a pickle (stagesafe/zero/pickle_limits.py, errors.shown): memory charged per opcode and per
call from a budget proportional to the pickle's size, keys of one hash, reprs bounded once. Each crafted pickle
of the second round of attacks (issue 25) is refused in memory proportional to its size; real pickles spend well
under the budget. tests/test_crafted_checkpoints.py runs the same files through ``stagesafe consolidate``."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from _hostile import (
    HOSTILE_PICKLES,
    byte_copies,
    colliding_int_keys,
    empty_sets,
    loss_scaler_levels,
    torch_save_pickle,
    traced_peak,
)

from stagesafe.errors import CheckpointFormatError, shown
from stagesafe.zero import pickle_reader
from stagesafe.zero.pickle_limits import MAX_SAME_HASH, MEMORY_BASE, MEMORY_PER_BYTE
from stagesafe.zero.pickle_reader import read_pickle

pytestmark = pytest.mark.timeout(60)

DISPLAY = "ckpt/zero_pp_rank_0_mp_rank_00_optim_states.pt"
P = 2**61 - 1  # Python hashes an int modulo P


def read(data: bytes):
    return read_pickle(data, display=DISPLAY)


# The issue's crafted pickles (empty_sets at 2 MB here; the 10 MB one runs in tests/test_crafted_checkpoints.py)
# -> what the refusal says.
REFUSED = {
    "colliding_int_keys": "share one hash",
    "set_calls_of_a_big_list": "crafted to exhaust memory or time",
    "bytearray_copies": "crafted to exhaust memory or time",
    "encode_copies": "crafted to exhaust memory or time",
    "empty_sets": "crafted to exhaust memory or time",
    # issue 39: copies of one memoized value, charged at each call or BUILD that is given it again
    "arrays_of_one_buffer": "crafted to exhaust memory or time",
    "shared_build_state_stand-in": "crafted to exhaust memory or time",
    "shared_build_state_namespace": "crafted to exhaust memory or time",
    "shared_build_state_ordered_dict": "crafted to exhaust memory or time",
    "shared_build_state_known": "crafted to exhaust memory or time",
    "zero_size_items": r"8589934592 elements\) from 0 bytes: an array's element count is checked apart",
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_each_crafted_pickle_is_refused_in_memory_proportional_to_its_size(name):
    data = empty_sets(2 * 2**20) if name == "empty_sets" else HOSTILE_PICKLES[name]()
    with traced_peak() as peak, pytest.raises(CheckpointFormatError, match=rf"cannot be read.*{REFUSED[name]}"):
        read(data)
    assert peak[0] < 1.25 * (MEMORY_PER_BYTE * len(data) + MEMORY_BASE), (peak, len(data))


def test_sixty_levels_of_stand_ins_sharing_their_parts_are_shown_in_one_short_line():
    """Each level's two attributes are the level below: a repr that starts its bound afresh at every level takes
    2 ** 60 steps; one bound for the whole message takes a few hundred."""
    value = read(loss_scaler_levels(60))["optimizer_state_dict"]["zero_stage"]
    text = shown(value, 120)
    assert len(text) < 160 and text.startswith("<deepspeed.runtime.fp16.loss_scaler.LossScaler (not imported)")


def test_a_shown_container_touches_a_few_items_whatever_its_size():
    touched = []

    class Watched(dict):
        def items(self):
            for item in super().items():
                touched.append(item[0])
                yield item

    level = Watched(leaf=list(range(10**6)))
    for depth in range(30):
        level = Watched({f"k{i}": level for i in range(100)})
    assert len(shown(level, 200)) < 260 and len(touched) < 200


def test_a_value_whose_repr_has_several_lines_is_shown_on_one():
    """Found by the fuzz target: a numpy array called (REDUCE) made a two-line error message."""
    import numpy as np

    data = torch_save_pickle(np.arange(6).reshape(2, 3))[:-1] + b")R."
    with pytest.raises(CheckpointFormatError, match=r"array\(\[\[0, 1, 2\], \[3, 4, 5\]\]\) is called") as info:
        read(data)
    assert "\n" not in str(info.value)


def test_keys_of_one_hash_are_refused_past_the_limit_per_container():
    assert len(read(_dict_of([(k + 1) * P for k in range(MAX_SAME_HASH)]))) == MAX_SAME_HASH
    with pytest.raises(CheckpointFormatError, match="share one hash"):
        read(_dict_of([(k + 1) * P for k in range(MAX_SAME_HASH + 1)]))
    many_dicts = b"\x80\x02](" + _dict_of([P], whole=False) * 1000 + b"e."  # one such key in each of 1000 dicts
    assert len(read(many_dicts)) == 1000
    small = [P - 2 - k for k in range(1000)] + [-k for k in range(1000)]  # hash to themselves (-1 to -2)
    assert len(read(_dict_of(small))) == 2000
    with pytest.raises(CheckpointFormatError, match="share one hash"):
        floats_of_hash_1 = {float(2 ** (61 * k)) for k in range(-16, 17)}  # 2 ** 61 is 1 modulo P
        read(torch_save_pickle({"s": floats_of_hash_1}))


def test_a_set_of_keys_of_one_hash_is_refused_when_built_by_a_call():
    items = b"".join(_long((k + 1) * P) for k in range(200))
    with pytest.raises(CheckpointFormatError, match="share one hash"):
        read(b"\x80\x02c__builtin__\nset\n](" + items + b"e\x85R.")


def test_pickles_torch_save_writes_spend_less_than_the_budget_per_byte(monkeypatch):
    """With no fixed allowance, a DeepSpeed optimizer's pickle and a Lightning client state read all the same."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    names = [f"model.layers.{i // 10}.block.sub{i % 10}.weight" for i in range(3000)]
    slices = OrderedDict((k, fragment_address(numel=4, start=4 * i)) for i, k in enumerate(names))
    optimizer = {
        "optimizer_state_dict": {
            "zero_stage": 2, "loss_scaler": LossScaler(1.0), "partition_count": [2],
            "single_partition_of_fp32_groups": [torch.zeros(10)],
            "base_optimizer_state": {
                "state": {i: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)} for i in range(3000)},
                "param_groups": [{"params": list(range(3000)), "lr": 0.1}],
            },
            "param_slice_mappings": [slices],
        }
    }  # fmt: skip
    model = {
        "module": OrderedDict((k, torch.zeros(2, 2)) for k in names),
        "param_shapes": [OrderedDict((k, torch.Size([2, 2])) for k in names)],
        "hyper_parameters": {f"k{i}": [i, 0.5, "x" * (i % 7)] for i in range(3000)},
    }
    monkeypatch.setattr(pickle_reader, "MEMORY_BASE", 0)
    for obj in (optimizer, model):
        data = torch_save_pickle(obj)
        assert len(data) > 500_000
        read(data)


def test_hyperparameters_of_numpy_arrays_namespaces_and_stand_ins_spend_less_than_the_budget(monkeypatch):
    """What issue 39's charges count (a numpy array's bytes at its BUILD, a BUILD state's attributes) leaves real
    hyperparameters well inside the budget."""
    import argparse

    import numpy as np

    rng = np.random.default_rng(0)
    hparams = {
        "arrays": [rng.random(1000) for _ in range(100)] + [np.zeros(2**20, dtype=np.uint8)],
        "args": argparse.Namespace(**{f"option_{i}": i for i in range(3000)}),
        "configs": [_Config(i) for i in range(2000)],
    }
    monkeypatch.setattr(pickle_reader, "MEMORY_BASE", 0)
    data = torch_save_pickle({"hyper_parameters": hparams})
    assert len(data) > 1_000_000
    read(data)


class _Config:
    """A user's dataclass-like object: a stand-in of its class, its attributes a dict."""

    def __init__(self, i: int):
        self.lr, self.name, self.layers = 0.1 * i, f"run{i}", [i, i + 1]


def _long(value: int) -> bytes:
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _dict_of(keys: list[int], *, whole: bool = True) -> bytes:
    body = b"}(" + b"".join(_long(k) + b"N" for k in keys) + b"u"
    return b"\x80\x02" + body + b"." if whole else body


def test_the_byte_copies_of_the_issue_would_take_gigabytes():
    """The refusal above is not for want of a case: 4,000 copies of 1 MiB are 4 GiB, and the budget is 33 MiB."""
    data = byte_copies()
    assert 4000 * 2**20 > 100 * (MEMORY_PER_BYTE * len(data) + MEMORY_BASE)
    assert len(colliding_int_keys(1000)) > 12_000  # 13 bytes a key: 200,000 keys in 2.6 MB
