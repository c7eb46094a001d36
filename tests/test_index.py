"""handoff/index.py: Hugging Face's index, built and inverted."""

from __future__ import annotations

from _pure import PURE, imports_of

import stagesafe.handoff.index
from stagesafe.handoff.index import build_index, shard_names


def test_it_imports_neither_torch_nor_fsspec():
    assert imports_of(stagesafe.handoff.index) <= PURE


def test_build_index_is_huggingface_layout():
    index = build_index({"a": "model-00001-of-00001.safetensors"}, 40)
    assert index == {"metadata": {"total_size": 40}, "weight_map": {"a": "model-00001-of-00001.safetensors"}}


def test_shard_names_inverts_a_weight_map_in_its_order_with_every_shard_listed():
    weight_map = {"b": "s2", "a": "s1", "c": "s2"}
    assert shard_names(weight_map, ["s1", "s2", "s3"]) == {"s1": ["a"], "s2": ["b", "c"], "s3": []}
