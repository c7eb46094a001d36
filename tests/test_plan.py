"""The plan of a handoff: shards filled up to the limit, tied weights stored once, entries a handoff cannot
store refused before anything is written, and the same plan whichever path makes it."""

from __future__ import annotations

import pytest
import torch
from _handoffs import files, url
from _tensors import assert_bitwise_equal

from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff.plan import plan_specs
from stagesafe.handoff.read import load_state_dict
from stagesafe.handoff.save import save_state_dict


def test_a_tensor_over_the_limit_gets_its_own_shard(url):
    sd = {"small": torch.zeros(10), "big": torch.zeros(1000), "small2": torch.zeros(10)}
    manifest = save_state_dict(sd, url, max_shard_size=100)
    assert [len(v) for v in _by_shard(manifest).values()] == [1, 1, 1]
    assert_bitwise_equal(load_state_dict(url), sd)


def _by_shard(manifest):
    out = {}
    for name, file in manifest["weight_map"].items():
        out.setdefault(file, []).append(name)
    return out


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


def _layout(shards, tensors, aliases, total_size):
    """A plan or a manifest, its shard names left out (each write tags its own): the names stored in each
    shard, in order, and the tensors, aliases and size recorded."""
    return [list(names) for names in shards.values()], dict(tensors), dict(aliases), total_size


def test_every_path_plans_the_same_shards_for_the_same_tensors(tmp_path):
    """save_state_dict, the strategy (plan_specs, from dtypes and shapes alone) and consolidate (from a ZeRO
    checkpoint's description) put the same tensors in the same shards, and record them alike."""
    from _hostile import write_zero_checkpoint

    from stagesafe.consolidate import consolidate
    from stagesafe.handoff.manifest import shard_names

    g = torch.Generator().manual_seed(0)
    params = {"embed.weight": torch.randn(16, 4, generator=g), "layer.weight": torch.randn(8, 16, generator=g),
              "layer.bias": torch.randn(8, generator=g), "out.weight": torch.randn(3, 8, generator=g)}
    buffers = {"norm.steps": torch.arange(5)}

    def tie_head(kind, rank, states):  # head.weight is embed.weight, as DeepSpeed records a tied parameter
        if kind == "model":
            states["shared_params"] = {"head.weight": "embed.weight"}

    ckpt = write_zero_checkpoint(str(tmp_path / "ckpt"), params, buffers=buffers, edit=tie_head)
    sd = {**buffers, **params, "head.weight": params["embed.weight"]}  # the checkpoint's state-dict order
    limit = 300  # several shards, one tensor over the limit

    saved = save_state_dict(sd, str(tmp_path / "saved"), max_shard_size=limit)
    specs = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for name, t in sd.items()}
    planned = plan_specs(specs, {"head.weight": "embed.weight"}, max_shard_size=limit)
    consolidated = consolidate(ckpt, str(tmp_path / "consolidated"), max_shard_size=limit)

    def of_manifest(m):
        return _layout(shard_names(m["weight_map"], list(m["shards"])), m["tensors"], m["aliases"], m["total_size"])

    expected = _layout(planned.shards, planned.tensors, planned.aliases, planned.total_size)
    assert len(expected[0]) > 2 and expected[2] == {"head.weight": "embed.weight"}
    assert of_manifest(saved) == expected
    assert of_manifest(consolidated) == expected
