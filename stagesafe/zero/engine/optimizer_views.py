"""The kept optimizer state seen per parameter by the optimizer given back after a fit, without a copy.

At one rank each trained parameter's elements lie whole and in order in one of the engine's flat fp32 partitions,
and so do its per-element optimizer state's (Adam's ``exp_avg`` and ``exp_avg_sq``): a view of the parameter's
shape into the kept state is the very tensor stock's optimizer would hold. :func:`state_places`, read while the
engine lives, records where each parameter's slice sits (the kept optimizer file, the number the torch optimizer's
state dict gives its flat partition, the offset in it); :func:`attach_views`, once the engine is gone, fills the
given-back optimizer's ``state`` with views into the kept files (a one-value state such as ``step`` copied per
parameter, as torch's optimizers hold it) and returns the :class:`OptimizerViews` that owns them: its
:meth:`~OptimizerViews.drop` empties that state when the kept state goes (the next fit's engine takes it over),
so that no view outlives its owner and the moments are never held twice.

A ``step()`` between calls runs in place on those views (the kept state then matches no weights: ``on_step``); one
on parameters held in 16 bits (layers built in ``configure_model`` under ``bf16-mixed``) beside fp32 state is
refused before anything changes, as torch's optimizers cannot step them together. At several ranks a rank holds
only its partition of each parameter's state: no views (the state stays empty).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stagesafe.errors import InvalidArgumentError, shown

__all__ = ["StatePlaces", "OptimizerViews", "state_places", "attach_views"]

# Where DeepSpeed's optimizer state dict holds the torch optimizer's own: ZeRO-3, then ZeRO 1/2 and BF16_Optimizer.
_TORCH_STATE_KEYS = ("optimizer_state_dict", "base_optimizer_state")


@dataclass(frozen=True)
class Place:
    """A trained parameter's slice of this rank's flat partitions: the torch state dict's ``number`` of the flat
    partition, the ``offset`` of the parameter's first element in it, the parameter's full ``shape``."""

    param: nn.Parameter
    name: str
    number: int
    offset: int
    shape: torch.Size


@dataclass(frozen=True)
class StatePlaces:
    """Where every trained parameter's optimizer state lies in the kept checkpoint ``file`` (one rank)."""

    file: str
    places: tuple[Place, ...]


def state_places(engine: Any) -> StatePlaces | None:
    """Read from a live training engine: each trained parameter's place in its flat partition, where a
    parameter's state is whole on this rank (one rank, and every parameter in one slice of one partition); None
    otherwise (several ranks, an engine whose optimizer stagesafe does not lay out)."""
    import os

    import torch.distributed as dist

    from stagesafe.zero.engine.checkpoint_load import partition_layout, state_numbers

    if dist.is_initialized() and dist.get_world_size() != 1:
        return None
    try:
        layout = partition_layout(engine)
        file = os.path.basename(engine._get_zero_ckpt_name("", ""))
        params = {name: param for param, name in engine.param_names.items()}
    except Exception:  # noqa: BLE001 - an optimizer not laid out so: the given-back optimizer's state stays empty
        return None
    places = []
    for number, index in enumerate(state_numbers(layout)):
        for name, offset, first, count in layout[index].slices:
            param = params.get(name)
            if param is None:
                return None
            shape = torch.Size(param.ds_shape if hasattr(param, "ds_shape") else param.shape)  # ZeRO-3's: full
            if first != 0 or count != shape.numel():
                return None  # a parameter in pieces: not one view
            places.append(Place(param, name, number, offset, shape))
    return StatePlaces(file, tuple(places))


class OptimizerViews:
    """The views an optimizer's ``state`` holds into the kept state, owned here: :meth:`drop` empties that state.
    ``on_step``: called once the optimizer stepped on them (the kept state then matches no weights)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, state: dict[nn.Parameter, dict[str, Any]], names: Mapping[int, str],
        *, on_step: Callable[[], None],
    ) -> None:
        self.state: defaultdict[nn.Parameter, dict[str, Any]] = defaultdict(dict, state)
        self._names = dict(names)
        self._on_step = on_step
        optimizer.state = self.state
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step)]

    def drop(self) -> None:
        """The kept state goes: the optimizer's state (if it is still this one) is emptied, the hooks removed."""
        self.state.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Refuse a step on a parameter held in another dtype than its state, before anything changes."""
        if optimizer.state is not self.state:
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                held = self.state.get(param, {})
                dtypes = {v.dtype for v in held.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
                if param.grad is not None and dtypes - {param.dtype}:
                    raise InvalidArgumentError(
                        f"{type(optimizer).__name__}.step() between Trainer calls: the parameter "
                        f"{shown(self._names.get(id(param), '?'))} is held in {param.dtype} and its optimizer state, "
                        f"the one the last fit kept, in {', '.join(sorted(str(d) for d in dtypes))}, which torch's "
                        "optimizers cannot step together (layers built in configure_model under a 16-bit precision "
                        "are held in it between calls; their fp32 masters are kept beside them). Train them with "
                        "trainer.fit(...), which steps the fp32 masters; nothing was changed"
                    )

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer.state is self.state:
            self._on_step()


def attach_views(
    optimizer: torch.optim.Optimizer, files: Mapping[str, Mapping[str, Any]], places: StatePlaces,
    *, on_step: Callable[[], None],
) -> OptimizerViews | None:
    """Fill ``optimizer.state`` with the kept state of each parameter in ``places``: views of its shape into
    the per-element tensors of the kept ``files`` (in host memory; no copy), a copy of each one-value state. None
    (the state left as it is) where the files do not hold the state as laid out (another form, a device tensor
    still to be copied off the device, a tensor too small)."""
    held = files.get(places.file, {}).get("optimizer_state_dict")
    torch_state = next((held[k] for k in _TORCH_STATE_KEYS if isinstance(held, Mapping) and k in held), None)
    numbered = torch_state.get("state") if isinstance(torch_state, Mapping) else None
    if not isinstance(numbered, Mapping):
        return None  # ZeRO 1/2's elastic form (a list per group), or nothing kept
    state: dict[nn.Parameter, dict[str, Any]] = {}
    for place in places.places:
        flat_state = numbered.get(place.number)
        if not isinstance(flat_state, Mapping) or not flat_state:
            continue  # no step yet: as stock, no state
        per_parameter = {}
        for key, value in flat_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                view = _view(value, place)
                if view is None:
                    return None
                per_parameter[key] = view
            elif isinstance(value, torch.Tensor):
                per_parameter[key] = value.detach().clone()
            else:
                per_parameter[key] = value
        state[place.param] = per_parameter
    return OptimizerViews(optimizer, state, {id(p.param): p.name for p in places.places}, on_step=on_step)


def _view(flat: torch.Tensor, place: Place) -> torch.Tensor | None:
    """The parameter's slice of ``flat``, of its shape, sharing its memory; None where that cannot be."""
    numel = place.shape.numel()
    if flat.device.type != "cpu" or not flat.is_contiguous() or flat.numel() < place.offset + numel:
        return None
    return flat.detach().view(-1).narrow(0, place.offset, numel).view(place.shape)
