"""stages/between_calls_checkpoint.py: trainer.save_checkpoint between calls without kept optimizer state writes
the module's weights as DeepSpeed's folder (rank 0), read back bitwise, with the warning that names what is
missing for a training checkpoint. (With the kept state, DeepSpeed's own files: tests/test_lifecycle.py.)"""

from __future__ import annotations

import os

import torch
from _tensors import assert_bitwise_equal

from stagesafe.consolidate import load_zero_checkpoint_with_client_state
from stagesafe.stages.between_calls_checkpoint import save_between_calls
from stagesafe.stages.history import state_tensors


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _save(module, checkpoint, path, *, rank_zero=True):
    warned, barriers = [], []
    save_between_calls(
        module, checkpoint, path, world_size=1, rank_zero=rank_zero, zero_stage=3, exclude_frozen=False,
        writers=[], barrier=barriers.append, warn=warned.append,
    )
    return warned, barriers


def test_without_kept_state_rank_0_writes_the_weights_and_says_what_is_missing(tmp_path):
    module = _module()
    path = str(tmp_path / "ckpt")
    checkpoint = {"state_dict": {}, "optimizer_states": [], "loops": {"fit_loop": {}}, "lr_schedulers": [{"x": 1}],
                  "epoch": 2}
    warned, barriers = _save(module, checkpoint, path)
    assert len(warned) == 1 and "no optimizer state" in warned[0] and "no fit under" in warned[0]
    assert barriers == []  # only rank 0 writes: nothing to wait for
    values, client = load_zero_checkpoint_with_client_state(path)
    assert_bitwise_equal(values, state_tensors(module))
    assert client["epoch"] == 2 and client["lr_schedulers"] == []  # schedulers start afresh with the optimizer
    assert "state_dict" not in client and "optimizer_states" not in client


def test_a_weights_only_checkpoint_is_written_without_a_warning_and_other_ranks_write_nothing(tmp_path):
    module = _module()
    warned, _ = _save(module, {"state_dict": {}, "epoch": 0}, str(tmp_path / "ckpt"))
    assert warned == []
    other = str(tmp_path / "other")
    _save(module, {"state_dict": {}}, other, rank_zero=False)
    assert not os.path.exists(other)
