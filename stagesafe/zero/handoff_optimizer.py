"""The optimizer state beside a handoff (:mod:`stagesafe.handoff.optimizer_state`), read as a ZeRO checkpoint's is.

:class:`HandoffOptimizer` answers what :mod:`stagesafe.zero.engine.checkpoint_load` asks of a checkpoint's
optimizer state (:class:`~stagesafe.zero.checkpoint_optimizer.CheckpointOptimizer`): which parameters are trained
in which param group, the keys held per element, the one-value state of each group, and any run of a parameter's
elements of a key (its fp32 master from the weights, a moment from the state). It has no ZeRO stage and no world
size: an engine of any stage and any number of ranks takes its own partitions from it. Every shard it reads is
checked against its manifest first (size, digest, contents), one shard at a time per reading thread.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, NamedTuple

from stagesafe.errors import CheckpointFormatError, shown
from stagesafe.storage.folder import Folder, check_workers, each
from stagesafe.handoff.optimizer_state import OptimizerForm, state_name
from stagesafe.handoff.read import read_shard

if TYPE_CHECKING:
    import torch

__all__ = ["HandoffOptimizer"]


class _Spec(NamedTuple):
    kind: str  # "param" (trained: the form holds its state) or "frozen" (any other tensor of the weights)
    shape: tuple[int, ...]


class HandoffOptimizer:
    """The optimizer state of the handoff at ``uri`` (its :class:`OptimizerForm`), per parameter."""

    stage = None  # any ZeRO stage takes it
    restores_hyperparameters = False  # the new job's optimizer keeps its own (lr, betas, ...): see the docs

    def __init__(self, form: OptimizerForm, uri: str, *, storage_options: dict[str, Any] | None = None) -> None:
        self.form, self.tag_url = form, uri
        self._options = storage_options
        weights = form.weights
        self._stored = {name: weights["aliases"].get(name, name) for name in weights["tensors"]}
        self.group_of = form.group_of()
        self.specs = {
            name: _Spec("param" if name in self.group_of else "frozen", tuple(meta["shape"]))
            for name, meta in weights["tensors"].items()
        }
        known = any(group.hyperparameters for group in form.groups)
        self.param_groups = [dict(group.hyperparameters) for group in form.groups] if known else None
        self.element_keys = list(form.keys)
        self.element_dtypes = {key: "float32" for key in form.keys}
        self.master_dtype = "float32"
        self.global_state = {"loss_scaler": form.loss_scaler} if form.loss_scaler is not None else {}

    def param_group_of(self, name: str) -> int:
        return self.group_of[name]

    def partition_of_group(self, group: int) -> int:
        return group

    def values(self, group: int) -> dict[str, Any]:
        """Param group ``group``'s one-value state (``step``) as ``torch.load`` would give it."""
        import torch

        out = {}
        for key, held in self.form.groups[group].state.items():
            dtype = held.get("dtype")
            out[key] = torch.tensor(held["value"], dtype=getattr(torch, dtype)) if dtype else held["value"]
        return out

    def read_all(self, reads: list[tuple[str, str | None, int, torch.Tensor]]) -> None:
        """Each ``(name, key, first, out)``: elements ``[first, first + out.numel())`` of the flattened parameter
        ``name``'s state ``key`` (None: its fp32 master) into ``out``; the shards that hold them read once each,
        a few at a time."""
        weights = Folder.at(self.tag_url, self._options)
        state = Folder.at(self.form.url, self._options)
        by_shard: dict[str, list[tuple[str, int, torch.Tensor]]] = defaultdict(list)
        for name, key, first, out in reads:
            if key is None:
                stored, folder, manifest = self._stored[name], "w", self.form.weights
            else:
                stored, folder, manifest = state_name(key, name), "s", self.form.manifest
            by_shard[f"{folder}/{manifest['weight_map'][stored]}"].append((stored, first, out))
        folders = {"w": (weights, self.form.weights), "s": (state, self.form.manifest)}

        def one(item: str, stop: Any) -> None:
            which, _, file_name = item.partition("/")
            folder, manifest = folders[which]
            tensors = read_shard(folder, manifest, file_name)
            for stored, first, out in by_shard[item]:
                flat = tensors[stored].view(-1)
                if first + out.numel() > flat.numel():
                    raise CheckpointFormatError(
                        f"{folder.url!r}: {shown(stored)} holds fewer than the {first + out.numel()} elements asked for"
                    )
                out.copy_(flat.narrow(0, first, out.numel()))
            del tensors

        each(sorted(by_shard), one, check_workers(None, weights.fs))
