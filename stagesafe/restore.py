"""Put a handoff's weights into a module: fresh, hollowed out by DeepSpeed, or on the meta device.

Checks that the handoff fits before anything changes, so a bad handoff never leaves a half-loaded module.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from stagesafe.zero import engine as _zero
from stagesafe.errors import StateDictMismatchError
from stagesafe.handoff.read import load_state_dict
from stagesafe.zero.engine import full_shape, is_zero3_param

__all__ = ["restore", "load_for", "check_fits", "assign_values"]


def _expected_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """State-dict names and full shapes (a ZeRO-3 placeholder reports its real shape in ``ds_shape``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        shapes[name] = tuple(full_shape(param))
    for prefix_module_name, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{prefix_module_name}." if prefix_module_name else ""
        for buf_name, buf in sub._buffers.items():
            if buf is not None and buf_name not in sub._non_persistent_buffers_set:
                shapes[prefix + buf_name] = tuple(buf.shape)
    return shapes


def check_fits(module: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Raise :class:`StateDictMismatchError` listing missing, unexpected and reshaped keys."""
    expected = _expected_shapes(module)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    reshaped = sorted(
        f"{name}: module {list(expected[name])} vs {list(state_dict[name].shape)}"
        for name in set(expected) & set(state_dict)
        if tuple(state_dict[name].shape) != expected[name]
    )
    if missing or unexpected or reshaped:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("reshaped", reshaped)):
            if items:
                shown = ", ".join(items[:10]) + (f", ... ({len(items)} in all)" if len(items) > 10 else "")
                parts.append(f"{label} keys: {shown}")
        raise StateDictMismatchError(
            "The weights do not fit the module (" + "; ".join(parts) + "). The module was not changed; "
            "check that the handoff was written for this model class and configuration."
        )


def assign_values(module: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Make ``values`` (state-dict name -> tensor) the module's parameters and buffers, without copying.

    Parameter objects keep their identity (tied weights stay tied, user references stay valid), except when a
    tensor moves to or from the meta device, which ``.data`` cannot do: there each parameter is replaced
    everywhere it is registered (tied ones by one new object), keeping ``requires_grad``.
    """
    replaced: dict[int, torch.Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for table in (sub._parameters, sub._buffers):
            for local_name, current in list(table.items()):
                name = f"{prefix}.{local_name}" if prefix else local_name
                if current is None or name not in values:
                    continue
                if id(current) in replaced:
                    table[local_name] = replaced[id(current)]
                elif (current.device.type == "meta") != (values[name].device.type == "meta"):
                    new = values[name]
                    if isinstance(current, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=current.requires_grad)
                    replaced[id(current)] = table[local_name] = new
                else:
                    current.data = values[name]
                    replaced[id(current)] = current


def load_for(
    module: nn.Module,
    uri: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    device: Any = None,
    progress: bool | None = None,
) -> dict[str, torch.Tensor]:
    """The handoff's tensors, checked to fit ``module`` and placed as it holds its own (dtype, device); the
    module itself is not touched, so a caller can check every rank before any of them changes. ``progress``:
    as :func:`~stagesafe.handoff.read.load_state_dict`'s."""
    values = load_state_dict(uri, storage_options=storage_options, progress=progress)
    check_fits(module, values)
    current = dict(module.named_parameters(remove_duplicate=False))
    for name, buf in module.named_buffers(remove_duplicate=False):
        current.setdefault(name, buf)
    placed: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        target = current[name]
        where = device if device is not None else ("cpu" if target.device.type == "meta" else target.device)
        dtype = target.dtype if target.numel() or not is_zero3_param(target) else value.dtype
        placed[name] = value.to(device=where, dtype=dtype)
    return placed


def restore(
    module: nn.Module, uri: str, *, storage_options: Mapping[str, Any] | None = None, device: Any = None
) -> nn.Module:
    """Load the handoff at ``uri`` into ``module`` and return it.

    Each tensor keeps the module's current dtype, and its device (``device`` overrides; meta tensors are
    materialised on the CPU). DeepSpeed state an earlier engine left on the module is removed, so this also
    rescues a module that stock DeepSpeed left hollow. Nothing changes unless the whole handoff loads and fits.
    """
    placed = load_for(module, uri, storage_options=storage_options, device=device)
    _zero.strip_deepspeed_state(module, None)
    assign_values(module, placed)
    return module
