"""A fit's optimizer state handed off beside its weights, in the form no number of ranks is written into.

With ``StageSafeDeepSpeedStrategy(handoff_optimizer_state=True)`` the end of a ``fit`` that trained writes, while
its engine still lives and before the weights, what ``stagesafe consolidate --optimizer`` writes of a checkpoint
(:mod:`stagesafe.handoff.optimizer_state`): one fp32 tensor per parameter and per-element key (Adam's moments),
the step counts, hyperparameters and loss scaler as JSON, in a folder ``optimizer-<tag>`` of the handoff, committed
first; the weights' manifest then binds it (:func:`write_optimizer_handoff` returns that binding). Every rank
describes its optimizer (state that is not per parameter is refused on every rank), then the ranks gather the
state one shard at a time onto rank 0, which writes that shard and lets it go: host memory beyond the engine's
own is one shard and its gather (:data:`STAGING`), never the whole state. Every step is a collective, in the
same order on every rank; a storage failure on rank 0 lets the gathers run out, then fails on every rank, the
state's shards deleted and the weights' handoff left to be written without it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from stagesafe.handoff.cleanup import delete_shards
from stagesafe.publishing.commit import commit
from stagesafe.handoff.names import INDEX_NAME
from stagesafe.handoff.optimizer_state import FormGroup, binding, form_metadata, new_folder, remove_state, state_name
from stagesafe.handoff.plan import plan_specs
from stagesafe.handoff.shards import ShardRecord, write_shards
from stagesafe.stages import collectives
from stagesafe.stages.history import HandoffTarget
from stagesafe.storage.folder import Folder
from stagesafe.storage.fs import join, resolve
from stagesafe.zero.engine.optimizer_out import EngineOptimizer, StateGather, describe_optimizer

__all__ = ["STAGING", "write_optimizer_handoff", "forget_optimizer_handoff"]

STAGING = 512 * 2**20  # bytes of state in one shard: rank 0 holds one, and its gather, at a time (about 1 GiB)


def write_optimizer_handoff(engine: Any, target: HandoffTarget, max_shard_size: int, *, source: Mapping[str, Any],
                            phases: dict[str, float] | None = None) -> dict[str, Any]:
    """Write the engine's optimizer state per parameter into a new folder of ``target``, in shards of at most
    ``max_shard_size`` bytes, and commit it; return, on every rank, the weights' metadata entry that binds it
    (:func:`~stagesafe.handoff.optimizer_state.binding`). Every rank calls it, in step. ``source``: what the form's
    JSON says it came from."""
    start = time.perf_counter()
    described = collectives.all_ranks(lambda: describe_optimizer(engine),
                                      "reading the optimizer state to hand off beside the weights")
    gather = collectives.all_ranks(lambda: StateGather(engine, described),
                                   "exchanging where each rank's optimizer partitions lie")
    pairs = {state_name(key, name): (key, name) for name, _, _ in described.trained for key in described.keys}
    shapes = {name: shape for name, shape, _ in described.trained}
    specs = {stored: {"dtype": "float32", "shape": list(shapes[name])} for stored, (_, name) in pairs.items()}
    limit = min(max_shard_size, STAGING)
    values: dict[str, torch.Tensor] = {}
    plan = plan_specs(specs, {}, max_shard_size=limit, state_dict=values)  # the same shards on every rank
    writing = _Writing(target) if collectives.rank() == 0 else None
    for file, names in plan.shards.items():
        bucket = gather.bucket([pairs[stored] for stored in names])  # a collective: every rank, every shard
        if writing is not None and bucket is not None:
            values.update({state_name(*pair): tensor for pair, tensor in bucket.items()})
            writing.shard(plan, file)
            values.clear()
    bound = collectives.on_rank_zero(lambda: writing.commit(plan, described, source),  # type: ignore[union-attr]
                                     f"committing the optimizer state beside the handoff {target.uri}")
    if phases is not None:
        phases["optimizer_state"] = time.perf_counter() - start
    return bound


class _Writing:
    """Rank 0's side: the state's new folder, its shards as they come, then the commit (or, after a failure,
    every shard of the write deleted)."""

    def __init__(self, target: HandoffTarget) -> None:
        self.records: dict[str, ShardRecord] = {}
        self.error: BaseException | None = None
        self.folder = self.state_root = ""
        try:  # a failure here too waits for the gathers to run out: the other ranks are in them
            self.fs, self.root = resolve(target.uri, dict(target.storage_options or {}))
            self.folder = new_folder(self.fs, self.root)
            self.state_root = join(self.root, self.folder)
        except BaseException as exc:  # noqa: BLE001 - raised at the commit
            self.error = exc

    def shard(self, plan: Any, file: str) -> None:
        if self.error is not None:  # the gathers run out on every rank; the failure is said at the commit
            return
        try:
            self.records.update(write_shards(self.fs, self.state_root, plan, [file], workers=1))
        except BaseException as exc:  # noqa: BLE001 - raised at the commit, once the other ranks are done
            self.error = exc

    def commit(self, plan: Any, described: EngineOptimizer, source: Mapping[str, Any]) -> dict[str, Any]:
        if self.error is not None:
            self._remove()
            raise self.error
        try:
            manifest = commit(self.fs, self.state_root, plan, self.records,
                              metadata=form_metadata(keys=described.keys, groups=_groups(described),
                                                     loss_scaler=described.loss_scaler, source=source))
        except BaseException:
            self._remove()
            raise
        return binding(self.folder, manifest)

    def _remove(self) -> None:
        if not self.state_root:
            return
        try:
            delete_shards(self.fs, self.state_root, self.records)
            Folder(self.fs, self.state_root).remove([INDEX_NAME], empty_root=True)
        except Exception:  # noqa: BLE001 - the failure that brought us here is the one raised
            pass


def _groups(described: EngineOptimizer) -> list[FormGroup]:
    return [
        FormGroup(params=tuple(name for name, _, g in described.trained if g == group),
                  hyperparameters=described.hyperparameters[group], state=described.values[group])
        for group in range(len(described.hyperparameters))
    ]


def forget_optimizer_handoff(target: HandoffTarget, folder: str) -> None:
    """The weights that were to bind the state in ``folder`` were not committed: delete it (rank 0; best effort,
    a state no weights name is read by nothing)."""
    if collectives.rank() != 0:
        return
    try:
        remove_state(*resolve(target.uri, dict(target.storage_options or {})), folder)
    except Exception:  # noqa: BLE001 - the weights' failure is the one raised
        pass
