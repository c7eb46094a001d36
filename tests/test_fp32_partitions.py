"""ZeRO-3's fp32 master partitions kept as recipes (stagesafe/zero/engine/fp32_partitions.py): built from the full
values, they are the very tensors DeepSpeed saves, their padding's bits included; with plain tensors, and on a
real ZeRO-3 engine of two gloo ranks whose parameters the ranks do not divide evenly."""

from __future__ import annotations

import os

import pytest
import torch
from _launch import two_ranks  # noqa: F401 - a fixture
from torch import nn

from stagesafe.zero.engine import PartitionRecipe, built_partitions


def test_a_recipe_places_each_slice_and_its_padding_where_the_flat_partition_has_them():
    values = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.arange(10, 15, dtype=torch.float32)}
    # rank 1 of 2: a's elements 3..5 at offset 0; b's 3..4 (then one of padding, -7) at offset 3
    recipe = PartitionRecipe(numel=6, dtype=torch.float32, slices=(("a", 0, 3, 3), ("b", 3, 3, 2)),
                             padding=((5, torch.tensor([-7.0])),))
    assert recipe.names == {"a", "b"}
    assert recipe.build(values).tolist() == [3.0, 4.0, 5.0, 13.0, 14.0, -7.0]
    with pytest.raises(ValueError, match="fp32 master partition"):
        recipe.build({**values, "a": values["a"].bfloat16()})


def test_built_partitions_builds_every_recipe_in_new_containers_and_shares_the_rest():
    recipe = PartitionRecipe(numel=2, dtype=torch.float32, slices=(("w", 0, 0, 2),))
    moments = torch.ones(2)
    state = {"optim": {"optimizer_state_dict": {"fp32_flat_groups": [recipe], "state": {0: {"exp_avg": moments}}},
                       "ds_version": "0.19.8"}}
    built = built_partitions(state, {"w": torch.tensor([1.5, 2.5])})
    assert built["optim"]["optimizer_state_dict"]["fp32_flat_groups"][0].tolist() == [1.5, 2.5]
    assert built["optim"]["optimizer_state_dict"]["state"][0]["exp_avg"] is moments  # shared, not copied
    assert state["optim"]["optimizer_state_dict"]["fp32_flat_groups"] == [recipe]  # the kept state unchanged


class _Odd(nn.Module):
    """Parameters of 15, 3, 21 and 7 elements: two ranks' partitions end in padding."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 3), nn.Linear(3, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _kept_partitions_against_deepspeeds_save(folder: str) -> dict:
    """On each rank: keep the engine's checkpoint files with recipes, build them from the full masters, and
    compare them with what DeepSpeed's own save writes for this rank."""
    import deepspeed
    import torch.distributed as dist

    from stagesafe.zero import engine as zero_engine

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # what a launcher sets, and DeepSpeed asks for
    torch.manual_seed(0)
    model = _Odd()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    for _ in range(2):  # AdamW moves the padding too (weight decay): its bits are the engine's own
        engine.backward(engine(torch.randn(1, 5)).pow(2).mean())
        engine.step()
    names = {id(p): n for n, p in model.named_parameters()}
    files = zero_engine.checkpoint_files(engine, exclude_frozen=False, names=names)
    masters = {n: deepspeed.utils.safe_get_full_fp32_param(p).detach().clone() for n, p in model.named_parameters()}
    engine.save_checkpoint(folder, tag="saved")
    dist.barrier()
    (optim,) = [name for name in files if "optim_states" in name]
    recipes = files[optim]["optimizer_state_dict"]["fp32_flat_groups"]
    built = zero_engine.built_partitions(files, masters)[optim]["optimizer_state_dict"]["fp32_flat_groups"]
    saved = torch.load(os.path.join(folder, "saved", optim), map_location="cpu", weights_only=False)
    theirs = saved["optimizer_state_dict"]["fp32_flat_groups"]
    engine.destroy()
    return {
        "recipes": all(isinstance(r, PartitionRecipe) for r in recipes),
        "padded": sum(p.numel() for r in recipes for _, p in r.padding),
        "equal": len(built) == len(theirs) and all(
            torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(built, theirs)),
    }


@pytest.mark.slow
def test_recipes_of_two_ranks_build_the_partitions_deepspeed_saves_padding_included(two_ranks, tmp_path):
    rank0, rank1 = two_ranks.run(_kept_partitions_against_deepspeeds_save, str(tmp_path))
    for seen in (rank0, rank1):
        assert not isinstance(seen, BaseException), seen
        assert seen["recipes"] and seen["equal"], seen
    assert rank0["padded"] == 0 and rank1["padded"] == 1 + 1 + 1 + 1  # each odd parameter's last element pads rank 1


def test_a_held_partition_is_built_from_its_own_values_where_the_kept_files_are_built():
    """The optimizer's moments shared per parameter by a host's ranks (stages/shared_state.py) are kept as
    HeldPartitions: built_partitions gives the flat partition DeepSpeed saves, from the values held with it."""
    from stagesafe.zero.engine import HeldPartition

    moments = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.arange(10, 12, dtype=torch.float32)}
    held = HeldPartition(PartitionRecipe(numel=4, dtype=torch.float32, slices=(("a", 0, 3, 3),),
                                         padding=((3, torch.tensor([0.5])),)), moments)
    state = {"optim": {"optimizer_state_dict": {"state": {0: {"exp_avg": held, "step": torch.tensor(3.0)}}}}}
    built = built_partitions(state, {"a": torch.zeros(2, 3)})  # the masters' values: not the moments'
    assert built["optim"]["optimizer_state_dict"]["state"][0]["exp_avg"].tolist() == [3.0, 4.0, 5.0, 0.5]
    assert state["optim"]["optimizer_state_dict"]["state"][0]["exp_avg"] is held
