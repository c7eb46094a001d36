"""A ZeRO checkpoint's optimizer state read per parameter (stagesafe.zero.checkpoint_optimizer), whatever number of
ranks wrote it: each parameter's slice of every per-element state sits where its fp32 master does; one-value state
(the step) per group; state that is neither is refused, naming it. Checkpoints in DeepSpeed's layout written here
(tests/_hostile.py), with moments whose values say where they came from."""

from __future__ import annotations

import pytest
import torch

from _hostile import write_zero_checkpoint
from stagesafe.errors import CheckpointFormatError
from stagesafe.zero.checkpoint import open_zero_checkpoint
from stagesafe.zero.checkpoint_optimizer import CheckpointOptimizer

PARAMS = {  # odd sizes: every world size pads
    "embed.weight": torch.arange(37 * 5, dtype=torch.float32).reshape(37, 5) / 7,
    "body.weight": -torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5) / 3,
    "body.bias": torch.arange(7, dtype=torch.float32) + 0.5,
}


def _with_state(stage: int, *, elastic: bool = False, state=None):
    """An ``edit`` that gives each rank's optimizer file Adam's state: exp_avg = 2 x and exp_avg_sq = 3 x its fp32
    partition, step 5 (``state(rank, flat)`` replaces that state)."""

    def edit(kind, rank, states):
        if kind != "optim":
            return
        osd = states["optimizer_state_dict"]
        flat = osd["fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"][0]
        held = state(rank, flat) if state is not None else {
            "step": torch.tensor(5.0), "exp_avg": flat * 2, "exp_avg_sq": flat * 3
        }
        groups = [{"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.1, "params": [0]}]
        if stage == 3:
            osd["optimizer_state_dict"] = {"state": {0: held}, "param_groups": groups}
        elif elastic:
            osd["base_optimizer_state"] = [{k: v for k, v in held.items() if k != "step"}]
            osd["base_optimizer_state_step"] = 5
        else:
            osd["base_optimizer_state"] = {"state": {0: held}, "param_groups": groups}

    return edit


def _opened(tmp_path, stage: int, world_size: int, **kwargs) -> CheckpointOptimizer:
    folder = write_zero_checkpoint(str(tmp_path / "ckpt"), PARAMS, stage=stage, world_size=world_size,
                                   edit=_with_state(stage, **kwargs))
    return CheckpointOptimizer(open_zero_checkpoint(folder))


def _read(source: CheckpointOptimizer, name: str, key: str | None, first: int, count: int) -> torch.Tensor:
    out = torch.full((count,), float("nan"))
    source.read_into(name, key, first, out)
    return out


@pytest.mark.parametrize(("stage", "world_size"), [(3, 2), (3, 3), (2, 2), (2, 3), (1, 4)])
def test_each_parameters_moments_are_read_where_its_master_lies_on_any_rank(tmp_path, stage, world_size):
    source = _opened(tmp_path, stage, world_size)
    assert source.element_keys == ["exp_avg", "exp_avg_sq"] and source.value_keys == ["step"]
    assert float(source.values(0)["step"]) == 5.0
    assert source.param_groups[0]["lr"] == 0.1 and source.group_of == {n: 0 for n in PARAMS}
    for name, value in PARAMS.items():
        flat = value.reshape(-1)
        n = flat.numel()
        for first, count in ((0, n), (3, min(11, n - 3)), (n - 4, 4)):  # across rank boundaries too
            expected = flat[first : first + count]
            assert torch.equal(_read(source, name, None, first, count), expected)
            assert torch.equal(_read(source, name, "exp_avg", first, count), expected * 2)
            assert torch.equal(_read(source, name, "exp_avg_sq", first, count), expected * 3)


def test_zero2s_elastic_form_is_read_with_its_step(tmp_path):
    source = _opened(tmp_path, 2, 3, elastic=True)
    assert source.param_groups is None and source.values(0) == {"step": 5}
    assert torch.equal(_read(source, "body.bias", "exp_avg", 0, 7), PARAMS["body.bias"] * 2)


def test_state_that_is_not_per_element_is_refused_naming_it(tmp_path):
    def preconditioner(rank, flat):
        return {"step": torch.tensor(1.0), "exp_avg": flat.clone(), "preconditioner": torch.eye(3)}

    with pytest.raises(CheckpointFormatError, match=r"'preconditioner' is a tensor of shape \[3, 3\].*cannot be "
                       r"re-partitioned.*per-parameter tensors"):
        _opened(tmp_path, 3, 2, state=preconditioner)


def test_ranks_holding_other_state_keys_are_refused(tmp_path):
    def uneven(rank, flat):
        return {"exp_avg": flat.clone(), **({"exp_avg_sq": flat.clone()} if rank == 0 else {})}

    with pytest.raises(CheckpointFormatError, match=r"rank 1, partition 0 holds \['exp_avg'\]"):
        _opened(tmp_path, 3, 2, state=uneven)


def test_a_frozen_or_unknown_name_has_no_optimizer_state(tmp_path):
    source = _opened(tmp_path, 3, 2)
    with pytest.raises(KeyError):
        _read(source, "no.such.weight", "exp_avg", 0, 1)
    with pytest.raises(CheckpointFormatError, match="fewer than the 40 elements"):
        _read(source, "body.bias", "exp_avg", 0, 40)
