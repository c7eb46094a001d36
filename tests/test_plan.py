"""handoff/plan.py: shards filled up to the limit, in order, from plain data (no torch), and the same plan
whichever path makes it."""

from __future__ import annotations

import pytest
import torch
from _handoffs import url
from _pure import PURE, imports_of
from _tensors import assert_bitwise_equal

import stagesafe.handoff.plan
from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff.plan import dtype_name, plan_shards, plan_specs, supported_dtype
from stagesafe.handoff.read import load_state_dict
from stagesafe.publishing.save import save_state_dict


def test_it_imports_neither_torch_nor_fsspec():
    assert imports_of(stagesafe.handoff.plan) <= PURE


def test_plan_shards_greedy_in_order_like_huggingface():
    entries = [("a", 10), ("b", 10), ("c", 10), ("d", 25), ("e", 5), ("f", 5)]
    assert plan_shards(entries, 20) == [["a", "b"], ["c"], ["d"], ["e", "f"]]


def test_plan_shards_exact_fit_and_oversized_tensor_alone():
    assert plan_shards([("a", 10), ("b", 10)], 20) == [["a", "b"]]
    assert plan_shards([("a", 1), ("big", 100), ("c", 1)], 10) == [["a"], ["big"], ["c"]]
    assert plan_shards([("big", 100)], 10) == [["big"]]


def test_plan_shards_zero_size_and_empty():
    assert plan_shards([("a", 10), ("empty", 0), ("b", 0)], 10) == [["a", "empty", "b"]]
    assert plan_shards([], 10) == []
    with pytest.raises(InvalidArgumentError):
        plan_shards([("a", 1)], 0)


def test_a_plan_from_dtypes_and_shapes_alone_knows_each_shards_bytes():
    specs = {"a": {"dtype": "bfloat16", "shape": [3, 4]}, "b": {"dtype": "float32", "shape": [5]},
             "t": {"dtype": "bfloat16", "shape": [3, 4]}, "c": {"dtype": "float8_e4m3fn", "shape": [7]}}
    plan = plan_specs(specs, {"t": "a"}, max_shard_size=30, tag="0badcafe")
    assert list(plan.shards.values()) == [["a"], ["b", "c"]]  # 24 bytes, then 20 + 7: "t" is stored as "a"
    assert [plan.shard_nbytes(f) for f in plan.shards] == [24, 27] and plan.total_size == 51
    assert list(plan.shards) == ["model-0badcafe-00001-of-00002.safetensors", "model-0badcafe-00002-of-00002.safetensors"]
    first, second = plan.shards
    assert plan.weight_map == {"a": first, "b": second, "c": second}
    assert list(plan.tensors) == ["a", "b", "t", "c"] and plan.aliases == {"t": "a"}


def test_a_dtype_safetensors_cannot_store_is_refused_when_planned():
    assert supported_dtype("bfloat16") and not supported_dtype("complex128")
    assert dtype_name(torch.bfloat16) == dtype_name("bfloat16") == "bfloat16"
    with pytest.raises(InvalidArgumentError, match="complex128"):
        plan_specs({"w": {"dtype": "complex128", "shape": [2]}}, {}, max_shard_size=10)


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


def _layout(shards, tensors, aliases, total_size):
    """A plan or a manifest, its shard names left out (each write tags its own): the names stored in each
    shard, in order, and the tensors, aliases and size recorded."""
    return [list(names) for names in shards.values()], dict(tensors), dict(aliases), total_size


def test_every_path_plans_the_same_shards_for_the_same_tensors(tmp_path):
    """save_state_dict, the strategy (plan_specs, from dtypes and shapes alone) and consolidate (from a ZeRO
    checkpoint's description) put the same tensors in the same shards, and record them alike."""
    from _hostile import write_zero_checkpoint

    from stagesafe.consolidate import consolidate
    from stagesafe.handoff.index import shard_names

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
