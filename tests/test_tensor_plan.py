"""handoff/tensor_plan.py: a state dict's plan: tied weights stored once, entries a handoff cannot store refused
before anything is written."""

from __future__ import annotations

import pytest
import torch
from _handoffs import files, url

from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff.read import load_state_dict
from stagesafe.publishing.save import save_state_dict
from stagesafe.handoff.tensor_plan import plan_handoff


def test_a_plan_of_tensors_is_the_plan_of_their_dtypes_and_shapes():
    sd = {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.ones(5)}
    sd["t"] = sd["a"]
    plan = plan_handoff(sd, max_shard_size=30, tag="0badcafe")
    assert list(plan.shards.values()) == [["a"], ["b"]] and plan.aliases == {"t": "a"}
    assert plan.tensors == {"a": {"dtype": "bfloat16", "shape": [3, 4]}, "b": {"dtype": "float32", "shape": [5]},
                            "t": {"dtype": "bfloat16", "shape": [3, 4]}}
    assert plan.shard_tensors(next(iter(plan.shards)))["a"] is sd["a"]  # the values are the caller's, not copies


def test_tied_weights_are_stored_once_and_come_back_as_one_object(url):
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11, bias=False))
    model[1].weight = model[0].weight  # tied, as lm_head and the embedding of a language model
    sd = model.state_dict()  # .detach() gives distinct objects over the same memory
    assert sd["1.weight"] is not sd["0.weight"]
    manifest = save_state_dict(sd, url)
    assert manifest["aliases"] == {"1.weight": "0.weight"}
    assert list(manifest["weight_map"]) == ["0.weight"]
    assert manifest["total_size"] == 11 * 4 * 4
    loaded = load_state_dict(url)
    assert list(loaded) == ["0.weight", "1.weight"]
    assert loaded["1.weight"] is loaded["0.weight"]
    assert torch.equal(loaded["0.weight"], model[0].weight.detach())


def test_views_same_exactly_are_aliases_overlapping_ones_copies(url):
    base = torch.arange(12, dtype=torch.float32)
    sd = {
        "base": base,
        "head": base[0:6],  # overlaps base and mid: written as its own copy
        "mid": base[4:10],
        "head_again": base[0:6],  # the very same view as head: an alias
        "evens": base[::2],  # non-contiguous view
        "as_int": base.view(torch.int32),  # same bytes, another dtype: not an alias
    }
    manifest = save_state_dict(sd, url)
    assert manifest["aliases"] == {"head_again": "head"}
    loaded = load_state_dict(url)
    for name, want in sd.items():
        assert torch.equal(loaded[name], want), name
    assert loaded["head_again"] is loaded["head"]
    loaded["head"][0] = 100.0  # independent storage after loading
    assert loaded["base"][0] == 0.0 and loaded["mid"][0] == 4.0


@pytest.mark.parametrize(
    ("sd", "pattern"),
    [
        ({"w": [1.0, 2.0]}, r"state_dict\['w'\] is a list, not a torch.Tensor"),
        ({"w": torch.empty(3, device="meta")}, "meta device"),
        ({"w": torch.zeros(2, dtype=torch.complex128)}, "complex128"),
        ({"w": torch.zeros(3, 3).to_sparse()}, "to_dense"),
        ({3: torch.zeros(1)}, "key 3 must be a non-empty str"),
    ],
)
def test_state_dict_entries_that_cannot_be_stored(url, sd, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        save_state_dict(sd, url)
    assert files(url) == set()
