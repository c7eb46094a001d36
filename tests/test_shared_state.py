"""The kept optimizer state shared per parameter by the ranks of one host (stagesafe/stages/shared_state.py).

In one process (no process group: a host of one rank): a rank's slices of its flat partitions land in each
parameter's place, the files then hold HeldPartitions that build the very flats back (padding included), and what
refuses to share does so on every path. At 2 CPU ranks (tests/scripts/shared_state.py, a real Trainer): the
given-back optimizer's state is each parameter's moments bit for bit as DeepSpeed's own gather gives them, a
checkpoint written between calls holds the bits DeepSpeed's own save wrote at the fit's end, a ``step()`` on one
rank changes that rank's state alone (and the next checkpoint is then written without the state on every rank),
and the next fit lets the shared memory go."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _launch import SCRIPTS, run_script
from torch import nn

from stagesafe.stages.shared_state import share_moments
from stagesafe.zero.engine import FlatSlices, HeldPartition, StatePlaces, built_partitions
from stagesafe.zero.engine.optimizer_views import Place

FILE = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _rank_one_of_two() -> tuple[StatePlaces, dict, dict[str, torch.Tensor]]:
    """Rank 1 of 2 over parameters a (2x3) and b (1 element: rank 1 holds none of it), one flat partition of 4:
    a's elements 3..5 at offset 0, then b's slot, padding only here (its bits -7)."""
    a, b = nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(1))
    places = StatePlaces(FILE, (Place(a, "a", 0, -1, torch.Size([2, 3])), Place(b, "b", 0, -1, torch.Size([1]))),
                         (FlatSlices(0, 4, (("a", 0, 3, 3),)),))
    exp_avg, exp_avg_sq = torch.tensor([3.0, 4.0, 5.0, -7.0]), torch.tensor([30.0, 40.0, 50.0, -70.0])
    files = {FILE: {"optimizer_state_dict": {"optimizer_state_dict": {"state": {0: {
        "step": torch.tensor(2.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}}}}}}
    return places, files, {"exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}


def _state(files: dict) -> dict:
    return files[FILE]["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]


def test_a_ranks_slices_land_in_each_parameters_place_and_the_files_build_the_same_flats_again():
    places, files, flats = _rank_one_of_two()
    shared = share_moments(files, places)
    assert shared is not None and not shared.ready(0.0)
    shared.fill(files)
    assert shared.ready(0.0)
    state = _state(files)
    assert isinstance(state["exp_avg"], HeldPartition) and isinstance(state["exp_avg_sq"], HeldPartition)
    assert state["step"].item() == 2.0  # one value: left as it is
    assert state["exp_avg"].values["a"].shape == (2, 3) and state["exp_avg"].values["b"].shape == (1,)
    assert state["exp_avg"].values["a"].flatten()[3:].tolist() == [3.0, 4.0, 5.0]  # this rank's part
    built = built_partitions(files, {})
    for key, flat in flats.items():
        assert torch.equal(_state(built)[key], flat)  # padding's bits included


def test_nothing_is_shared_without_kept_files_per_element_state_or_a_layout_as_the_flats():
    places, files, _ = _rank_one_of_two()
    assert share_moments(None, places) is None
    no_step = {FILE: {"optimizer_state_dict": {"optimizer_state_dict": {"state": {}}}}}
    assert share_moments(no_step, places) is None  # no step yet: as stock, no state
    _state(files)["exp_avg"] = torch.zeros(5)  # not laid out as the flat partition of 4
    assert share_moments(files, places) is None


def test_a_fill_that_fails_is_marked_so_that_no_rank_waits_for_it():
    places, files, _ = _rank_one_of_two()
    shared = share_moments(files, places)
    assert shared is not None
    _state(files)["exp_avg"] = torch.zeros(8)[::2]  # not contiguous: refused
    with pytest.raises(ValueError, match="contiguous host tensor"):
        shared.fill(files)
    assert not shared.ready(60.0)  # at once


def test_a_rank_that_gives_up_is_not_waited_for():
    places, files, _ = _rank_one_of_two()
    shared = share_moments(files, places)
    assert shared is not None
    shared.give_up()
    assert not shared.ready(60.0)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_share_the_kept_moments_bit_for_bit_and_let_them_go_at_the_next_fit(tmp_path):
    results = _two_ranks(tmp_path)
    for rank, seen in results.items():
        assert seen["shapes"] == SHAPES, rank  # whole, though rank 1 holds none of net.2.bias
        assert seen["equal_to_deepspeed"], rank
        assert seen["regions"] == 1, rank
        assert seen["between_equal_to_own"], rank
        # after rank 0's step, every rank writes the weights alone (rank 0's state matches them no more)
        assert seen["after_step_files"] == ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                            "zero_pp_rank_0_mp_rank_00_optim_states.pt"], rank
        assert seen["old_state_after_next_fit"] == 0 and seen["new_state"] == 4 and seen["new_optimizer"], rank
        assert not seen["first_region_still_mapped"] and seen["regions_after_next_fit"] == 1, rank
    assert results[0]["changed_by_step"] == sorted(SHAPES)
    assert results[1]["changed_by_step"] == []  # rank 0's step changed rank 0's state alone


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_of_layers_built_in_configure_model_under_bf16_share_fp32_moments_and_refuse_a_step(tmp_path):
    """The module Lightning holds in bf16 between calls; its state is DeepSpeed's fp32 moments, bit for bit, on both
    ranks, and a ``step()`` that would round the fp32 masters is refused, touching nothing."""
    results = _two_ranks(tmp_path, "bf16")
    for rank, seen in results.items():
        assert seen["module_dtypes"] == ["torch.bfloat16"] and seen["state_dtypes"] == ["torch.float32"], rank
        assert seen["shapes"] == SHAPES and seen["equal_to_deepspeed"] and seen["regions"] == 1, rank
        assert seen["changed_by_step"] == [], rank
    assert "held in torch.bfloat16" in results[0]["step_refused"] and "trainer.fit" in results[0]["step_refused"]


SHAPES = {"net.0.weight": [[16, 8]] * 2, "net.0.bias": [[16]] * 2, "net.2.weight": [[1, 16]] * 2,
          "net.2.bias": [[1]] * 2}


def _two_ranks(root, *args: str) -> dict[int, dict]:
    """tests/scripts/shared_state.py at 2 CPU ranks: what each rank printed."""
    result = run_script(os.path.join(SCRIPTS, "shared_state.py"), [str(root), *args], timeout=300, cwd=str(root))
    results = {int(rank): json.loads(text) for _, rank, text in
               (line.split(" ", 2) for line in result.stdout.splitlines() if line.startswith("RESULT "))}
    assert sorted(results) == [0, 1]
    return results
