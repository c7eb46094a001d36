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
refused before anything changes, as torch's optimizers cannot step them together. At several ranks (ZeRO-3) a
rank holds only its partition of each parameter's state; where the ranks of one host share it whole per parameter
(:mod:`stagesafe.stages.shared_state`), the kept files hold each flat partition as a
:class:`~stagesafe.zero.engine.fp32_partitions.HeldPartition` and the views look into its shared values, once every
rank has written its part (``shared``); elsewhere there are no views (the state stays empty).

On a GPU the kept state is copied off the device after the Trainer call has returned (the call does not wait for
it): :func:`attach_views` given that copy's event fills the state on first use instead. Until the call has
returned (Lightning's own teardown reads the state) it is seen empty without waiting; from then on the first
read or ``step()`` waits for the copy, then finds the views.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.constants import default_pg_timeout

from stagesafe.errors import InvalidArgumentError, shown
from stagesafe.zero.engine.fp32_partitions import HeldPartition

__all__ = ["StatePlaces", "FlatSlices", "OptimizerViews", "state_places", "attach_views", "numbered_state"]

log = logging.getLogger(__name__)

# Where DeepSpeed's optimizer state dict holds the torch optimizer's own: ZeRO-3, then ZeRO 1/2 and BF16_Optimizer.
_TORCH_STATE_KEYS = ("optimizer_state_dict", "base_optimizer_state")


@dataclass(frozen=True)
class Place:
    """A trained parameter's state in the kept files: the torch state dict's ``number`` of its flat partition,
    the ``offset`` of the parameter's first element in it (-1 where this rank holds only a slice of it), the
    parameter's full ``shape``."""

    param: nn.Parameter
    name: str
    number: int
    offset: int
    shape: torch.Size


@dataclass(frozen=True)
class FlatSlices:
    """This rank's flat partition ``number`` of ``numel`` elements: ``slices`` (name, offset in the flat, first
    element of the flattened full parameter, elements) of the parameters it holds part of."""

    number: int
    numel: int
    slices: tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True)
class StatePlaces:
    """Where every trained parameter's optimizer state lies in the kept checkpoint ``file`` (one rank's).
    ``flats``: at several ranks, this rank's slices of each flat partition (the state of a parameter is then
    whole only where the ranks of a host share it: :mod:`stagesafe.stages.shared_state`)."""

    file: str
    places: tuple[Place, ...]
    flats: tuple[FlatSlices, ...] = ()


def state_places(engine: Any) -> StatePlaces | None:
    """Read from a live training engine: each trained parameter's place in the flat partitions (at one rank,
    where every parameter lies whole in one slice of one partition; at several, under ZeRO-3, with this rank's
    slices of each partition); None otherwise (ZeRO 1/2 at several ranks, an engine whose optimizer stagesafe
    does not lay out)."""
    import os

    import torch.distributed as dist

    from stagesafe.zero.engine.checkpoint_load import partition_layout, state_numbers

    several = dist.is_initialized() and dist.get_world_size() != 1
    try:
        layout = partition_layout(engine)
        file = os.path.basename(engine._get_zero_ckpt_name("", ""))
        params = {name: param for param, name in engine.param_names.items()}
        if several:
            return _places_of_partitions(engine, file, layout, state_numbers(layout))
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


def _places_of_partitions(engine: Any, file: str, layout: list[Any], numbers: list[int]) -> StatePlaces | None:
    """ZeRO-3 at several ranks: every parameter of each sub-group (a rank may hold none of a small one's
    elements), and this rank's slices of each flat partition."""
    from stagesafe.zero.engine.checkpoint_load import _names

    optimizer, names = engine.optimizer, _names(engine)
    groups = getattr(optimizer, "fp16_groups", None)
    if not hasattr(optimizer, "sub_group_to_group_id") or groups is None or len(groups) != len(layout):
        return None
    places, flats = [], []
    for number, index in enumerate(numbers):
        for param in groups[index]:
            name = names.get(id(param))
            if name is None:
                return None
            places.append(Place(param, name, number, -1, torch.Size(param.ds_shape)))
        flats.append(FlatSlices(number, int(layout[index].numel), tuple(layout[index].slices)))
    return StatePlaces(file, tuple(places), tuple(flats))


class _FilledOnFirstUse(defaultdict):
    """An optimizer's ``state`` that takes the views on its first use once the kept state is on the host
    (``copied`` set), waiting for that from :meth:`call_returned` on; before, it is seen as it is (empty).
    Made with :meth:`pending`; one made by ``defaultdict``'s own copy or pickle is a plain, filled one."""

    _fill: Callable[[], dict[nn.Parameter, dict[str, Any]] | None] | None = None
    _copied: threading.Event | None = None
    _may_wait = False
    _timeout = 0.0
    _lock = threading.Lock()

    @classmethod
    def pending(
        cls, fill: Callable[[], dict[nn.Parameter, dict[str, Any]] | None], copied: threading.Event, timeout: float
    ) -> "_FilledOnFirstUse":
        state = cls(dict)
        state._fill, state._copied, state._timeout, state._lock = fill, copied, timeout, threading.Lock()
        return state

    def call_returned(self) -> None:
        """The Trainer call has returned: the copy has started or will, so a read waits for it."""
        self._may_wait = True

    def cancel(self) -> None:
        """The kept state goes before the views were made: none will be."""
        if self._fill is not None:
            with self._lock:
                self._fill = None

    def _settle(self) -> None:
        if self._fill is None:
            return
        copied = self._copied
        assert copied is not None
        if not copied.is_set():
            if not self._may_wait:
                return  # the call's own teardown: the copy waits for it to return
            if not copied.wait(self._timeout):
                log.warning("stagesafe: the kept optimizer state was not copied off the device within %g s: "
                            "trainer.optimizers[0].state stays empty", self._timeout)
                self.cancel()
                return
        with self._lock:  # never held while waiting: cancel() comes from the thread that copies
            fill, self._fill = self._fill, None
            made = fill() if fill is not None else None
            for param, held in (made or {}).items():
                dict.setdefault(self, param, {}).update(held)  # an entry made meanwhile keeps its identity


def _settling(name: str) -> Callable[..., Any]:
    base = getattr(defaultdict, name)

    def method(self: _FilledOnFirstUse, *args: Any, **kwargs: Any) -> Any:
        self._settle()
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in ("__getitem__", "__setitem__", "__delitem__", "__contains__", "__iter__", "__len__", "__repr__",
              "__eq__", "__ne__", "__or__", "__ior__", "__reduce__", "keys", "values", "items", "get", "pop",
              "popitem", "setdefault", "update", "copy", "clear"):
    setattr(_FilledOnFirstUse, _name, _settling(_name))


class OptimizerViews:
    """The views an optimizer's ``state`` holds into the kept state, owned here: :meth:`drop` empties that state.
    ``on_step``: called once the optimizer stepped on them (the kept state then matches no weights)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, state: Mapping[nn.Parameter, dict[str, Any]], names: Mapping[int, str],
        *, on_step: Callable[[], None],
    ) -> None:
        if not isinstance(state, _FilledOnFirstUse):
            state = defaultdict(dict, state)
        self.state: defaultdict[nn.Parameter, dict[str, Any]] = state
        self._names = dict(names)
        self._on_step = on_step
        optimizer.state = self.state
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step)]

    def call_returned(self) -> None:
        """The Trainer call that gave the optimizer back has returned: a state still to be filled (its copy off
        the device follows now) is waited for from here on."""
        if isinstance(self.state, _FilledOnFirstUse):
            self.state.call_returned()

    def drop(self) -> None:
        """The kept state goes: the optimizer's state (if it is still this one) is emptied, the hooks removed."""
        if isinstance(self.state, _FilledOnFirstUse):
            self.state.cancel()
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
    *, on_step: Callable[[], None], copied: threading.Event | None = None,
    timeout: float = default_pg_timeout.total_seconds(),
    shared: Callable[[float], bool] | None = None,
) -> OptimizerViews | None:
    """Fill ``optimizer.state`` with the kept state of each parameter in ``places``: views of its shape into
    the per-element tensors of the kept ``files`` (in host memory; no copy), a copy of each one-value state. None
    (the state left as it is) where the files do not hold the state as laid out (another form, a device tensor
    still to be copied off the device, a tensor too small). ``copied``: the event of the copy off the device
    that makes the files' tensors host ones; the state is then filled on first use (the module's docstring),
    waiting ``timeout`` seconds at most (then it stays empty, as where no views can be made). ``shared(timeout)``:
    at several ranks, whether every rank of the host has written its part of the state they share, waiting
    ``timeout`` seconds at most (the views wait for it as for ``copied``)."""
    names = {id(p.param): p.name for p in places.places}

    def views() -> dict[nn.Parameter, dict[str, Any]] | None:
        if shared is not None and not shared(timeout):
            log.warning("stagesafe: a rank of this host did not write its part of the kept optimizer state (it "
                        "failed, or took over %g s): trainer.optimizers[0].state stays empty", timeout)
            return None
        return _views(files, places)

    if copied is not None:
        return OptimizerViews(optimizer, _FilledOnFirstUse.pending(views, copied, timeout), names, on_step=on_step)
    state = views()
    return OptimizerViews(optimizer, state, names, on_step=on_step) if state is not None else None


def _views(files: Mapping[str, Mapping[str, Any]], places: StatePlaces) -> dict[nn.Parameter, dict[str, Any]] | None:
    """Each laid-out parameter's state as views into ``files`` (:func:`attach_views`); None where it cannot be."""
    numbered = numbered_state(files, places.file)
    if numbered is None:
        return None  # ZeRO 1/2's elastic form (a list per group), or nothing kept
    state: dict[nn.Parameter, dict[str, Any]] = {}
    for place in places.places:
        flat_state = numbered.get(place.number)
        if not isinstance(flat_state, Mapping) or not flat_state:
            continue  # no step yet: as stock, no state
        per_parameter = {}
        for key, value in flat_state.items():
            if isinstance(value, HeldPartition):  # shared per parameter by the ranks of this host
                held = value.values.get(place.name)
                if held is None or held.numel() != place.shape.numel():
                    return None
                per_parameter[key] = held.view(place.shape)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                view = _view(value, place) if place.offset >= 0 else None
                if view is None:
                    return None
                per_parameter[key] = view
            elif isinstance(value, torch.Tensor):
                per_parameter[key] = value.detach().clone()
            else:
                per_parameter[key] = value
        state[place.param] = per_parameter
    return state


def numbered_state(files: Mapping[str, Mapping[str, Any]], file: str) -> dict[int, dict[str, Any]] | None:
    """The torch optimizer's per-partition state (number -> state) in the kept ``file``, None where it holds none
    so."""
    held = files.get(file, {}).get("optimizer_state_dict")
    torch_state = next((held[k] for k in _TORCH_STATE_KEYS if isinstance(held, Mapping) and k in held), None)
    numbered = torch_state.get("state") if isinstance(torch_state, Mapping) else None
    return numbered if isinstance(numbered, dict) else None


def _view(flat: torch.Tensor, place: Place) -> torch.Tensor | None:
    """The parameter's slice of ``flat``, of its shape, sharing its memory; None where that cannot be."""
    numel = place.shape.numel()
    if flat.device.type != "cpu" or not flat.is_contiguous() or flat.numel() < place.offset + numel:
        return None
    return flat.detach().view(-1).narrow(0, place.offset, numel).view(place.shape)
