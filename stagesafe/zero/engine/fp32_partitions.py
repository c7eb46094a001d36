"""This rank's fp32 master partitions of a ZeRO-3 optimizer, described instead of copied.

After a stage's end the module holds every trained parameter's fp32 master bit for bit (or, for a parameter it
holds in 16 bits, the boundary keeps that master), so this rank's flat fp32 partition of each optimizer
sub-group is those values again, sliced: 4 bytes per parameter and rank that need not be held twice. A
:class:`PartitionRecipe` records where each parameter's slice sits in the flat partition, and the values of its
padding (the last rank's slice of a parameter whose size the ranks do not divide: bytes no value holds), so
that :meth:`PartitionRecipe.build` gives the very tensor DeepSpeed would save, from the full values.

A :class:`HeldPartition` is such a flat partition held elsewhere per parameter, with the values it is built from:
the optimizer's per-element state (Adam's moments) once the ranks of one host share it whole per parameter
(:mod:`stagesafe.stages.shared_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PartitionRecipe", "HeldPartition", "partition_recipes", "built_partitions"]


@dataclass(frozen=True)
class PartitionRecipe:
    """One flat fp32 partition of ``numel`` elements: ``slices`` are (name, offset in the flat, first element
    of the flattened full value, elements), ``padding`` (offset, values) the rest."""

    numel: int
    dtype: torch.dtype
    slices: tuple[tuple[str, int, int, int], ...]
    padding: tuple[tuple[int, torch.Tensor], ...] = ()

    @property
    def names(self) -> set[str]:
        return {name for name, *_ in self.slices}

    def build(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The flat partition, from ``values`` (name -> the full fp32 value, as the module or the kept masters
        hold it)."""
        flat = torch.empty(self.numel, dtype=self.dtype)
        for name, offset, first, count in self.slices:
            value = values[name].detach().reshape(-1)
            if value.dtype != self.dtype:
                raise ValueError(f"the value of {name!r} is {value.dtype}, its fp32 master partition is {self.dtype}")
            flat.narrow(0, offset, count).copy_(value.narrow(0, first, count))
        for offset, values_there in self.padding:
            flat.narrow(0, offset, values_there.numel()).copy_(values_there)
        return flat


@dataclass(frozen=True)
class HeldPartition:
    """A flat partition whose elements are held in ``values`` (name -> the full value) as ``recipe`` lays out."""

    recipe: PartitionRecipe
    values: Mapping[str, torch.Tensor]

    def build(self) -> torch.Tensor:
        return self.recipe.build(self.values)


def partition_recipes(
    optimizer: Any, names: Mapping[int, str], *, read_padding: bool = True
) -> list[PartitionRecipe] | None:
    """A recipe for each of a ZeRO-3 optimizer's flat fp32 partitions on this rank (its ``fp32_flat_groups``),
    ``names`` giving each parameter's state-dict name by ``id``; None where the partitions cannot be described
    so (another ZeRO stage, offloaded or swapped masters, a parameter without a name, a layout not covered):
    the caller keeps them as they are. ``read_padding=False``: the padding's values are left out (one copy off
    the device saved, for a caller that only asks what would be kept)."""
    flats = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    groups = getattr(optimizer, "fp16_groups", None)
    if flats is None or groups is None or len(flats) != len(groups) or getattr(optimizer, "offload_optimizer", False):
        return None
    import torch.distributed as dist

    recipes = []
    pads: list[tuple[int, int, torch.Tensor]] = []  # (group, offset, device view): read in one copy at the end
    for index, (flat, params) in enumerate(zip(flats, groups)):
        if optimizer._swappable_optimizer_subgroup(index) or flat.numel() == 0:
            return None
        slices, covered = [], 0
        for param in params:
            name = names.get(id(param))
            position = optimizer.grad_position.get(optimizer.get_param_id(param))
            if name is None or position is None or int(position[0]) != index:
                return None
            _, offset, count = (int(x) for x in position)
            group = optimizer._get_param_partition_group(param)
            first = dist.get_rank(group=group) * count if dist.is_initialized() else 0
            real = max(0, min(count, int(param.ds_numel) - first))
            if real:
                slices.append((name, offset, first, real))
            if real < count:
                pads.append((index, offset + real, flat.detach().narrow(0, offset + real, count - real)))
            covered += count
        if covered != flat.numel():
            return None
        recipes.append(PartitionRecipe(numel=flat.numel(), dtype=flat.dtype, slices=tuple(slices)))
    return _with_padding(recipes, pads) if read_padding else recipes


def built_partitions(state: Any, values: Mapping[str, torch.Tensor]) -> Any:
    """``state`` (a kept checkpoint file's state, or anything inside one) with every :class:`PartitionRecipe`
    built from ``values`` and every :class:`HeldPartition` from its own; the containers are new, everything
    else is shared."""
    if isinstance(state, PartitionRecipe):
        return state.build(values)
    if isinstance(state, HeldPartition):
        return state.build()
    if isinstance(state, dict):
        built = state.copy()
        for key, value in state.items():
            built[key] = built_partitions(value, values)
        return built
    if type(state) in (list, tuple):
        return type(state)(built_partitions(value, values) for value in state)
    return state


def _with_padding(recipes: list[PartitionRecipe], pads: list[tuple[int, int, torch.Tensor]]) -> list[PartitionRecipe]:
    if not pads:
        return recipes
    host = torch.cat([view for _, _, view in pads]).to("cpu")  # one copy off the device for them all
    by_group: dict[int, list[tuple[int, torch.Tensor]]] = {}
    at = 0
    for index, offset, view in pads:
        by_group.setdefault(index, []).append((offset, host.narrow(0, at, view.numel()).clone()))
        at += view.numel()
    return [
        PartitionRecipe(r.numel, r.dtype, r.slices, tuple(by_group.get(i, ()))) for i, r in enumerate(recipes)
    ]
