"""What stagesafe remembers about a module between Trainer calls, whichever strategy ran them.

A module may go through several Trainers (a new one per call is common), so this is kept per module, not per
strategy: the dtype and device each tensor had before its first stage, which handoff holds its current
weights (checked by each tensor's identity and in-place version, so a change by the user is noticed), where
those weights come from (stage and step), the writer of its last handoff, which may still be running, and
what the last ``fit``'s engine held beyond the module's own tensors (:class:`KeptTraining`). No write's state
lives here: the writer owns it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from stagesafe.stages.writer import HandoffWriter
    from stagesafe.zero.engine.optimizer_views import OptimizerViews

__all__ = [
    "HandoffTarget", "KeptTraining", "ModuleHistory", "history_of", "new_history", "state_tensors", "fingerprint",
]

Fingerprint = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class HandoffTarget:
    """Where a module's handoff lives."""

    uri: str
    storage_options: Mapping[str, Any] | None = None


@dataclass
class KeptTraining:
    """What the last ``fit``'s engine held that the module's tensors cannot: the fp32 masters of parameters the
    module holds in 16 bits, and this rank's files of DeepSpeed's own checkpoint (optimizer partition, step
    counts, loss scaler) with Lightning's lr scheduler states. Valid while the module's tensors are the ones it
    was kept with (``fingerprint``): a module changed since has other weights than these masters and moments.
    """

    fingerprint: Fingerprint
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    checkpoint: dict[str, dict[str, Any]] | None = None  # file name in the tag folder -> its state
    lr_schedulers: list[dict[str, Any]] = field(default_factory=list)
    world_size: int = 1
    missing: str = ""  # why ``checkpoint`` is None: said when a checkpoint is saved without it
    views: OptimizerViews | None = field(default=None, compare=False, repr=False)  # what holds views into it
    outdated_by: str = ""  # what made it match no weights (:meth:`outdated`)
    # set once ``checkpoint``'s device tensors are copied off the device after the call (or never will be);
    # None: its tensors were on the host from the start
    copied: threading.Event | None = field(default=None, compare=False, repr=False)
    # at several ranks of one host, the per-element state they share (stages.shared_state.SharedMoments)
    shared: Any = field(default=None, compare=False, repr=False)

    def drop(self, missing: str) -> None:
        """Let go of the checkpoint files (``missing``: why there are none now), and of every view into them."""
        self.checkpoint, self.missing, self.shared = None, missing, None
        self.drop_views()

    def drop_views(self) -> None:
        """Empty the optimizer state that holds views into these files (the given-back optimizer's)."""
        views, self.views = self.views, None
        if views is not None:
            views.drop()

    def call_returned(self) -> None:
        """The Trainer call that kept this state has returned: views still to be filled may wait for the copy."""
        if self.views is not None:
            self.views.call_returned()

    def outdated(self, why: str) -> None:
        """Something stepped the optimizer on this state between calls (``why``, said when a checkpoint is saved
        without it): it matches no weights any more (neither the fp32 masters nor the checkpoint files are given
        for the module's tensors)."""
        self.fingerprint, self.outdated_by = {}, why

    def masters_for(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The fp32 masters of the tensors that are still the ones they were kept with."""
        now = fingerprint({n: t for n, t in tensors.items() if n in self.masters})
        return {n: m for n, m in self.masters.items() if now.get(n) == self.fingerprint.get(n)}

    def holds(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether the module's ``tensors`` are still exactly the ones this state was kept with."""
        return fingerprint(tensors) == self.fingerprint

    def moved(self, before: Fingerprint, tensors: Mapping[str, torch.Tensor]) -> None:
        """stagesafe itself replaced the module's tensors (``before`` -> ``tensors``), values unchanged."""
        if before == self.fingerprint:
            self.fingerprint = fingerprint(tensors)


@dataclass
class ModuleHistory:
    """A module's facts across Trainer calls."""

    original: dict[str, tuple[torch.dtype, torch.device]]  # per state-dict name, before its first stage
    target: HandoffTarget | None = None  # the handoff that holds the weights fingerprinted below
    fingerprint: Fingerprint | None = None  # None: no handoff is known to hold the module's weights
    weights_from: dict[str, Any] = field(default_factory=dict)  # {"stage", "global_step", "epoch"} of the weights
    kept: KeptTraining | None = None  # what the last fit's engine held beyond the module's tensors
    state_bound: tuple[str, Fingerprint] | None = None  # the handoff whose optimizer state is these tensors'
    # the optimizer the last fit gave back (held weakly) and the names of each of its groups' parameters
    given_back: "tuple[weakref.ref[torch.optim.Optimizer], list[list[str]]] | None" = None
    _writer: "weakref.ref[HandoffWriter] | None" = None

    def holds(self, target: HandoffTarget, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether the handoff at ``target`` holds exactly these tensors' values."""
        return self.target == target and self.fingerprint is not None and self.fingerprint == fingerprint(tensors)

    def written(self, target: HandoffTarget, tensors: Mapping[str, torch.Tensor], writer: "HandoffWriter") -> None:
        """A write of these tensors to ``target`` has started (a failed one calls :meth:`lost`)."""
        self.target, self.fingerprint = target, fingerprint(tensors)
        self._writer = weakref.ref(writer)

    def lost(self) -> None:
        """The handoff may not hold the module's weights: the next stage writes them again, naming no optimizer
        state (the one it named may be gone with it)."""
        self.fingerprint = None
        self.state_bound = None

    def bind_state(self, uri: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """The optimizer state that ``weights_from["optimizer"]`` names, in the handoff at ``uri``, is that of
        these tensors' values."""
        self.state_bound = (uri, fingerprint(tensors))

    def binds_state(self, uri: str, tensors: Mapping[str, torch.Tensor] | None) -> bool:
        """Whether weights written to ``uri`` from these ``tensors`` may name the optimizer state noted with
        :meth:`bind_state`: the same folder (the state's is inside it), the same values. Any other write names
        none: a state no weights name goes with the weights it replaces."""
        if tensors is None or self.state_bound is None:
            return False
        return self.state_bound == (uri, fingerprint(tensors))

    def moved_tensor(self, name: str, old: torch.Tensor, new: torch.Tensor) -> None:
        """stagesafe copied tensor ``old`` of ``name`` into ``new`` (same values, pages of its own): what was known
        of the one holds of the other (which handoff holds it, which kept state belongs to it)."""
        bound = self.state_bound[1] if self.state_bound is not None else None
        for prints in (self.fingerprint, self.kept.fingerprint if self.kept is not None else None, bound):
            if prints is not None and prints.get(name) == (old.data_ptr(), old._version):
                prints[name] = (new.data_ptr(), new._version)

    @property
    def writer(self) -> "HandoffWriter | None":
        return self._writer() if self._writer is not None else None

    def note_names(self, tensors: Mapping[str, torch.Tensor], fresh: Iterable[str] = ()) -> None:
        """Keep the original dtype and device of every current name; a name new to the module takes its own:
        the dtype it was built in (Lightning builds ``configure_model``'s layers in the precision's dtype, as
        stock keeps them). ``fresh``: parameters DeepSpeed's ``zero.Init`` just built and partitioned; their
        place between stages is the CPU."""
        fresh = set(fresh)
        for name, tensor in tensors.items():
            if name not in self.original:
                self.original[name] = (tensor.dtype, torch.device("cpu") if name in fresh else tensor.device)
        for name in [n for n in self.original if n not in tensors]:
            del self.original[name]


_HISTORY: "weakref.WeakKeyDictionary[nn.Module, ModuleHistory]" = weakref.WeakKeyDictionary()


def history_of(module: nn.Module) -> ModuleHistory | None:
    """The module's history, or None before its first stage under stagesafe."""
    return _HISTORY.get(module)


def new_history(module: nn.Module) -> ModuleHistory:
    """A fresh history for ``module``, kept as long as the module lives (weakly: it never keeps one alive)."""
    history = _HISTORY[module] = ModuleHistory(original={})
    return history


def state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state-dict tensors, detached (tied names share one tensor's storage)."""
    return {name: t.detach() for name, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> Fingerprint:
    """Identity and in-place version of each tensor: unchanged means the values are unchanged."""
    return {name: (t.data_ptr(), t._version) for name, t in tensors.items()}
