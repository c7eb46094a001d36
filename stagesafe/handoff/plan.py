"""The plan of a handoff: which tensor goes to which shard file, decided before a byte is written.

One builder, :func:`plan_specs`, makes every plan: from a state dict (:func:`plan_handoff`, for
``save_state_dict`` and the strategy's writer), from tensors known only by their dtypes and shapes (the
strategy, before it has the values), and from a DeepSpeed checkpoint's description (``consolidate``). So the
same tensors get the same shards whichever path writes them. No fsspec here, and torch only to look at the
tensors of a state dict.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff import codec
from stagesafe.handoff.manifest import (
    DEFAULT_MAX_SHARD_SIZE,
    SAFETENSORS_DTYPES,
    parse_size,
    plan_shards,
    shard_file_names,
)

if TYPE_CHECKING:
    import torch

__all__ = ["HandoffPlan", "dtype_name", "plan_handoff", "plan_specs"]

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
) -> HandoffPlan:
    """The plan for tensors known by ``specs`` (name -> ``{"dtype", "shape"}``, every name in state-dict order)
    and their tied-name ``aliases`` (stored once, under the name they point to): the same shards for the same
    specs, whoever asks.

    Shards are filled in the order of the stored names, up to ``max_shard_size`` bytes each, under file names of
    this commit's own: tagged ``tag`` (so that several ranks plan alike) or a random tag that avoids the names in
    ``taken``. ``sizes``: the bytes of each stored tensor, in the order shards are filled, for a caller that
    knows them without torch (by default they are computed from ``specs``). ``state_dict`` is where the writer
    takes the values from (a lazy mapping may read each one as its bytes are due).
    """
    limit = parse_size(max_shard_size)
    if sizes is None:
        sizes = {name: _nbytes(spec) for name, spec in specs.items() if name not in aliases}
    groups = plan_shards(sizes.items(), limit)
    shards = dict(zip(shard_file_names(len(groups), tag=tag, taken=taken), groups, strict=True))
    return HandoffPlan(
        shards=shards,
        weight_map={name: file for file, names in shards.items() for name in names},
        tensors={name: {"dtype": spec["dtype"], "shape": list(spec["shape"])} for name, spec in specs.items()},
        aliases=dict(aliases),
        total_size=sum(sizes.values()),
        state_dict=state_dict if state_dict is not None else {},
    )


def plan_handoff(
    state_dict: Mapping[str, torch.Tensor],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    taken: Iterable[str] = (),
    tag: str | None = None,
) -> HandoffPlan:
    """Plan the shards of ``state_dict`` (:func:`plan_specs` on its tensors), every entry checked first.

    Names that are the very same tensor view (tied weights) are stored once, under the first name; the others
    become aliases. ``tag`` fixes the names' tag, so that several ranks plan alike; without it, the names avoid
    those in ``taken``.
    """
    limit = parse_size(max_shard_size)
    if not isinstance(state_dict, Mapping):
        raise InvalidArgumentError(
            f"state_dict must be a mapping of str to torch.Tensor, got {type(state_dict).__name__}"
        )
    specs: dict[str, dict[str, Any]] = {}
    aliases: dict[str, str] = {}
    first_of: dict[tuple, str] = {}
    for name, tensor in state_dict.items():
        _check_entry(name, tensor)
        specs[name] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}
        key = _view_identity(tensor)
        if key is not None:
            canonical = first_of.setdefault(key, name)
            if canonical != name:
                aliases[name] = canonical
    return plan_specs(specs, aliases, max_shard_size=limit, tag=tag, taken=taken, state_dict=state_dict)


def dtype_name(dtype: torch.dtype | str) -> str:
    """A torch dtype's name as the format records it (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def _check_entry(name: Any, tensor: Any) -> None:
    import torch

    codec.check_name(name)
    where = f"state_dict[{name!r}]"
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(
            f"{where} is a {type(tensor).__name__}, not a torch.Tensor; a handoff stores tensors only "
            "(drop the entry, or put JSON values in metadata)"
        )
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(
            f"{where} has layout {tensor.layout}; safetensors stores dense tensors: pass .to_dense()"
        )
    if tensor.device.type == "meta":
        raise InvalidArgumentError(
            f"{where} is on the meta device and has no data (a ZeRO-3 parameter that was not gathered?); "
            "gather the full weights first"
        )
    if dtype_name(tensor.dtype) not in _SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            f"{where} has dtype {tensor.dtype}, which safetensors cannot store; convert it first"
        )


def _view_identity(tensor: torch.Tensor) -> tuple | None:
    """Equal for two tensors exactly when they are the same view of the same memory (tied weights)."""
    if tensor.numel() == 0:
        return None  # empty tensors share no bytes; distinct ones may even report the same null pointer
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _nbytes(spec: Mapping[str, Any]) -> int:
    import torch

    return math.prod(spec["shape"]) * getattr(torch, spec["dtype"]).itemsize
