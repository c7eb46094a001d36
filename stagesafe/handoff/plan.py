"""The plan of a handoff: which tensor goes to which shard file, decided before a byte is written.

One builder, :func:`plan_specs`, makes every plan: from a state dict
(:func:`~stagesafe.handoff.tensor_plan.plan_handoff`, for ``save_state_dict`` and the strategy's writer), from
tensors known only by their dtypes and shapes (the strategy, before it has the values), and from a DeepSpeed
checkpoint's description (``consolidate``). So the same tensors get the same shards whichever path writes them.
Pure: no torch and no fsspec; a plan is tested with plain data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff import codec
from stagesafe.handoff.codec import SAFETENSORS_DTYPES
from stagesafe.handoff.names import shard_file_names
from stagesafe.handoff.sizes import parse_size

if TYPE_CHECKING:
    import torch

__all__ = ["HandoffPlan", "dtype_name", "plan_shards", "plan_specs", "supported_dtype"]

_SUPPORTED_DTYPES = frozenset(SAFETENSORS_DTYPES.values())


@dataclass(frozen=True)
class HandoffPlan:
    """Which tensor goes to which shard file, decided before anything is written."""

    shards: dict[str, list[str]]  # shard file -> names stored in it, in state-dict order
    weight_map: dict[str, str]  # stored name -> shard file (Hugging Face's index)
    tensors: dict[str, dict[str, Any]]  # every name, aliases too, in state-dict order -> {"dtype", "shape"}
    aliases: dict[str, str]  # tied name -> the name it is stored under
    total_size: int  # bytes of tensor data stored
    state_dict: Mapping[str, torch.Tensor] = field(repr=False, compare=False)

    def shard_nbytes(self, file_name: str) -> int:
        """Bytes of tensor data stored in ``file_name`` (known from the plan, before anything is written)."""
        return sum(_nbytes(self.tensors[name]) for name in self.shards[file_name])

    def shard_tensors(self, file_name: str) -> dict[str, torch.Tensor]:
        """The tensors :func:`~stagesafe.handoff.shards.write_shard` writes into ``file_name``."""
        return {name: self.state_dict[name] for name in self.shards[file_name]}

    def shard_specs(self, file_name: str) -> dict[str, dict[str, Any]]:
        """``{"dtype", "shape"}`` of each tensor stored in ``file_name``, in the order it is written."""
        return {name: self.tensors[name] for name in self.shards[file_name]}

    def tagged(self, tag: str, *, state_dict: Mapping[str, Any] | None = None) -> HandoffPlan:
        """The same shards under file names tagged ``tag`` (a plan made before its write's tag was known), the
        values taken from ``state_dict`` (by default this plan's)."""
        shards = dict(zip(shard_file_names(len(self.shards), tag=tag), self.shards.values(), strict=True))
        return dataclasses.replace(
            self,
            shards=shards,
            weight_map={name: file for file, names in shards.items() for name in names},
            state_dict=self.state_dict if state_dict is None else state_dict,
        )


def plan_specs(
    specs: Mapping[str, Mapping[str, Any]],
    aliases: Mapping[str, str],
    *,
    max_shard_size: int | str,
    tag: str | None = None,
    taken: Iterable[str] = (),
    state_dict: Mapping[str, Any] | None = None,
    sizes: Mapping[str, int] | None = None,
    owned: bool = False,
) -> HandoffPlan:
    """The plan for tensors known by ``specs`` (name -> ``{"dtype", "shape"}``, every name in state-dict order)
    and their tied-name ``aliases`` (stored once, under the name they point to): the same shards for the same
    specs, whoever asks.

    Shards are filled in the order of the stored names, up to ``max_shard_size`` bytes each, under file names of
    this commit's own: tagged ``tag`` (so that several ranks plan alike) or a random tag that avoids the names in
    ``taken``. ``sizes``: the bytes of each stored tensor, in the order shards are filled, for a caller that
    knows them without torch (by default they are computed from ``specs``). ``state_dict`` is where the writer
    takes the values from (a lazy mapping may read each one as its bytes are due). ``owned``: ``specs`` was
    built for this plan alone (``{"dtype", "shape"}`` dicts, the shapes lists) and is kept, not copied.
    """
    limit = parse_size(max_shard_size)
    if sizes is None:
        sizes = {name: _nbytes(spec) for name, spec in specs.items() if name not in aliases}
    groups = plan_shards(sizes.items(), limit)
    shards = dict(zip(shard_file_names(len(groups), tag=tag, taken=taken), groups, strict=True))
    return HandoffPlan(
        shards=shards,
        weight_map={name: file for file, names in shards.items() for name in names},
        tensors=specs if owned else {n: {"dtype": s["dtype"], "shape": list(s["shape"])} for n, s in specs.items()},
        aliases=dict(aliases),
        total_size=sum(sizes.values()),
        state_dict=state_dict if state_dict is not None else {},
    )


def plan_shards(entries: Iterable[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Group ``(name, nbytes)`` greedily, in the given order, into shards of at most ``max_shard_size`` bytes.

    As huggingface_hub's ``split_state_dict_into_shards_factory``: a tensor larger than the limit gets a shard of
    its own. Unlike it, that shard takes its place in order, so file order follows state-dict order.
    """
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size <= 0:
        raise InvalidArgumentError(f"max_shard_size={max_shard_size!r} must be a positive number of bytes")
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, nbytes in entries:
        if current and current_size + nbytes > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += nbytes
    if current:
        shards.append(current)
    return shards


def dtype_name(dtype: torch.dtype | str) -> str:
    """A torch dtype's name as the format records it (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _DTYPE_NAMES[dtype]  # computed once per dtype: this runs per tensor
    except KeyError:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    except TypeError:  # unhashable: not a dtype, but named all the same in the error that follows
        name = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict[Any, str] = {}



def supported_dtype(name: str) -> bool:
    """Whether safetensors stores tensors of the dtype ``name`` (``"bfloat16"``)."""
    return name in _SUPPORTED_DTYPES


def _nbytes(spec: Mapping[str, Any]) -> int:
    if not supported_dtype(spec["dtype"]):
        raise InvalidArgumentError(
            f"a tensor of dtype {spec['dtype']!r} cannot be planned: safetensors cannot store it; convert it first"
        )
    return codec.nbytes(spec["dtype"], spec["shape"])
