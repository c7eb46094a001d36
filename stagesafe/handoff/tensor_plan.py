"""The plan of a state dict's tensors: each entry checked (a tensor safetensors stores), tied weights found (the
same view of the same memory, stored once), then :func:`~stagesafe.handoff.plan.plan_specs` on their dtypes and
shapes. The only planning that looks at torch tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff import codec
from stagesafe.handoff.plan import HandoffPlan, dtype_name, plan_specs, supported_dtype
from stagesafe.handoff.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size

if TYPE_CHECKING:
    import torch

__all__ = ["plan_handoff"]


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
    sizes: dict[str, int] = {}
    aliases: dict[str, str] = {}
    at: dict[int, str | list[str]] = {}  # data pointer -> the stored name(s) there: ties share one
    for name, tensor in state_dict.items():
        specs[name] = {"dtype": _checked_dtype(name, tensor), "shape": list(tensor.shape)}
        canonical = _tied_to(name, tensor, at, state_dict) if tensor.numel() else None
        if canonical is not None:
            aliases[name] = canonical
        else:
            sizes[name] = tensor.nbytes
    return plan_specs(
        specs, aliases, max_shard_size=limit, tag=tag, taken=taken, state_dict=state_dict, sizes=sizes, owned=True
    )


def _tied_to(name: str, tensor: Any, at: dict[int, str | list[str]], state_dict: Mapping[str, Any]) -> str | None:
    """The stored name ``tensor`` is the very same view as, if any; else it is recorded as stored. A tie needs
    the same data pointer, so the full identity is computed only for the rare names that share one."""
    ptr = tensor.data_ptr()
    there = at.setdefault(ptr, name)
    if there == name:
        return None
    names = [there] if isinstance(there, str) else there
    key = _view_identity(tensor)
    for other in names:
        if _view_identity(state_dict[other]) == key:
            return other
    at[ptr] = [*names, name]
    return None


def _checked_dtype(name: Any, tensor: Any) -> str:
    """The dtype name of a state dict's entry, once it is one a handoff stores (else :func:`_check_entry`'s
    error); the common case in a few attribute reads, since it runs once per tensor."""
    import torch

    if type(name) is str and isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided and not tensor.is_meta:
        dtype = dtype_name(tensor.dtype)
        if supported_dtype(dtype):
            codec.check_name(name)
            return dtype
    _check_entry(name, tensor)
    raise AssertionError(f"{name!r} passed _check_entry but not its quick form")  # pragma: no cover


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
    if not supported_dtype(dtype_name(tensor.dtype)):
        raise InvalidArgumentError(
            f"{where} has dtype {tensor.dtype}, which safetensors cannot store; convert it first"
        )


def _view_identity(tensor: torch.Tensor) -> tuple:
    """Equal for two tensors exactly when they are the same view of the same memory (tied weights). Empty
    tensors are never ties: they share no bytes, and distinct ones may report the same null pointer."""
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )
