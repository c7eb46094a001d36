"""What the handoff holds of an engine's values: exact fp32 masters, the module's original dtypes, and the exact
values the stage started with where the engine's 16-bit copy of them is unchanged. Plain tensors; a plain
module stands in for the engine's (no parameter has a master or a partition there)."""

from __future__ import annotations

import torch
from torch import nn

from _tensors import assert_bitwise_equal
from stagesafe.stages.engine_weights import StreamedValues, take_from_engine, to_handoff
from stagesafe.stages.history import state_tensors

_ORIGINAL = {"w": (torch.float32, torch.device("cpu")), "h": (torch.bfloat16, torch.device("cpu"))}


def test_an_unchanged_16_bit_value_gives_back_the_exact_value_the_stage_started_with():
    entry = {"w": torch.tensor([1.0 + 2**-20, 3.0])}  # not a bf16 number: a round trip would change it
    convert = to_handoff(_ORIGINAL, set(), entry)
    unchanged = entry["w"].to(torch.bfloat16)
    assert_bitwise_equal({"w": convert("w", unchanged)}, entry)
    changed = unchanged + 1
    assert_bitwise_equal({"w": convert("w", changed)}, {"w": changed.float()})


def test_a_master_is_taken_in_fp32_and_everything_else_in_its_original_dtype():
    convert = to_handoff(_ORIGINAL, {"h"}, {})
    master = torch.tensor([1.0 + 2**-20])
    assert_bitwise_equal({"h": convert("h", master)}, {"h": master})
    assert convert("w", torch.ones(2, dtype=torch.float16)).dtype == torch.float32
    assert to_handoff(_ORIGINAL, set(), {})("h", master).dtype == torch.bfloat16


def test_without_training_only_the_parameters_built_here_are_taken_from_the_engine():
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    module[1].weight = module[0].weight  # tied: one tensor under both names
    original = {n: (t.dtype, t.device) for n, t in state_tensors(module).items()}
    entry = {n: torch.full_like(t, 7.0) for n, t in state_tensors(module).items()}
    values, _ = take_from_engine(module, original, entry, trained=False, built={"0.bias"}, host=None)
    assert_bitwise_equal({n: values[n] for n in ("0.bias", "1.bias")}, {"0.bias": module[0].bias.detach(),
                                                                         "1.bias": entry["1.bias"]})
    assert values["1.weight"] is values["0.weight"]
    trained, _ = take_from_engine(module, original, entry, trained=True, built=set(), host=None)
    assert_bitwise_equal(trained, {n: t for n, t in state_tensors(module).items()})


def test_streamed_values_plan_the_writers_shards_and_leave_out_tied_names():
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(torch.bfloat16))
    module[1].weight = nn.Parameter(module[1].weight.detach())
    original = {n: (t.dtype, t.device) for n, t in state_tensors(module).items()}
    streamed = StreamedValues(module, original, {})
    assert streamed.specs["1.weight"] == {"dtype": "bfloat16", "shape": [2, 2]}
    assert list(streamed) == ["0.weight", "0.bias", "1.weight", "1.bias"] and streamed.aliases == {}
    assert_bitwise_equal({"0.bias": streamed["0.bias"]}, {"0.bias": module[0].bias.detach()})
    streamed.drain()  # the names not asked for are gathered (and dropped), as every rank's gathers must match
