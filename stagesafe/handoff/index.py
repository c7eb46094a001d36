"""``model.safetensors.index.json``, Hugging Face's index of which tensor is in which shard: built, and inverted.

Pure: plain dicts in, plain dicts out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["build_index", "shard_names"]


def build_index(weight_map: Mapping[str, str], total_size: int) -> dict[str, Any]:
    """The content of ``model.safetensors.index.json`` in Hugging Face's layout."""
    return {"metadata": {"total_size": int(total_size)}, "weight_map": dict(weight_map)}


def shard_names(weight_map: Mapping[str, str], shards: Sequence[str]) -> dict[str, list[str]]:
    """Invert a weight map: each shard file to the tensor names it holds, in weight-map order."""
    out: dict[str, list[str]] = {file: [] for file in shards}
    for name, file in weight_map.items():
        out.setdefault(file, []).append(name)
    return out
