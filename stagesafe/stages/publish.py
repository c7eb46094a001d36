"""A stage's weights handed to the handoff: the write request, its private copies, and the two other ways.

Three ways a stage boundary has its weights written: the strategy's :class:`~stagesafe.stages.writer.HandoffWriter`
starts a write (every rank here; in the background it reads private copies of the shards this rank writes,
which later changes to the module cannot reach); rank 0 writes alone, now (some rank is not here); or every
rank gathers and rank 0 writes one tensor at a time (a module that holds no weights between stages). Each
records what it did in the boundary's report and the module's history.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from stagesafe.boundary_report import BoundaryReport
from stagesafe.publishing.save import save_state_dict, save_streamed
from stagesafe.stages import collectives
from stagesafe.stages.engine_weights import StreamedValues
from stagesafe.stages.history import HandoffTarget, ModuleHistory, state_tensors
from stagesafe.stages.ownership import RUN
from stagesafe.stages.stage_end import StageEnd
from stagesafe.stages.writer import HandoffWriter, WriteRequest
from stagesafe.zero import engine as zero_engine

__all__ = ["HandoffPublisher", "handoff_metadata"]


def handoff_metadata(
    history: ModuleHistory, uri: str | None = None, tensors: Mapping[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """The handoff's metadata: where its weights come from, the module's original dtypes, and the run that
    writes it (:mod:`~stagesafe.stages.ownership`). The optimizer state the weights were bound to is named only
    where weights of ``tensors``' values go to ``uri`` again (:meth:`ModuleHistory.binds_state`)."""
    dtypes = {n: str(dtype).removeprefix("torch.") for n, (dtype, _) in history.original.items()}
    metadata = {**history.weights_from, "original_dtypes": dtypes, "run": dict(RUN)}
    if uri is None or not history.binds_state(uri, tensors):
        metadata.pop("optimizer", None)
    return metadata


class HandoffPublisher:
    """Has one boundary's weights written to its ``target`` (every rank calls each method, in step).

    ``report``: the boundary's :class:`~stagesafe.boundary_report.BoundaryReport`, which gets ``wrote``,
    ``handoff_bytes``, ``copied_while_waiting`` and the writer's phases. ``end``: the stage's end, which holds
    the handoff's plan, which names this rank writes and the host memory of their private copies.
    """

    def __init__(
        self, module: nn.Module, target: HandoffTarget, writer: HandoffWriter, end: StageEnd, report: BoundaryReport
    ) -> None:
        assert writer.uri == target.uri, "the boundary's writer is the writer of its handoff's folder"
        self._module = module
        self._target = target
        self._writer = writer
        self._end = end
        self._report = report

    def start(
        self,
        history: ModuleHistory,
        values: Mapping[str, torch.Tensor],
        tensors: Mapping[str, torch.Tensor],
        *,
        gathered: zero_engine.GatheredValues | None,
        background: bool,
        keep: Callable[[], None] | None = None,
        on_failed: Callable[[], None] | None = None,
    ) -> None:
        """Start the writer on ``values``, which the module's ``tensors`` hold, with the plan the stage made at its
        entry. A write that may outlast the call (``background``) reads private copies of the shards this rank
        writes. ``keep``: device work of the boundary's own for the writer's device thread, after those copies
        (the kept optimizer state's). ``on_failed``: more to undo, on every rank, if the write fails (the optimizer
        state this stage wrote for these weights)."""
        plan = self._end.plan_matching(values)
        mine = self._end.written_here or set()
        self._report.wrote = True
        self._report.handoff_bytes = plan.total_size
        if background:
            private, fill = self._private_copies(values, gathered, mine)
        else:
            private, fill = {n: values[n] for n in mine}, None
        request = WriteRequest(
            values=private,
            plan=plan,
            metadata=handoff_metadata(history, self._target.uri, tensors),
            fill=fill,
            unlock=self._end.after_call,
            phases=self._report.phases,
            on_failed=history.lost if on_failed is None else _both(history.lost, on_failed),
            keep=keep,
        )
        history.written(self._target, tensors, self._writer)
        self._writer.start(request)

    def alone(self, history: ModuleHistory, values: Mapping[str, torch.Tensor]) -> None:
        """Some rank is not here: rank 0 writes the handoff alone, now (``wait_for_handoff()`` on the other
        ranks waits for it), and every rank forgets whether the handoff holds the weights, so that the next
        stage, in step again, writes it once more."""
        self._report.wrote = True
        history.lost()
        target, metadata = self._target, handoff_metadata(history)
        self._writer.write_alone(
            lambda: save_state_dict(values, target.uri, max_shard_size=self._end.max_shard_size, overwrite=True,
                                    metadata=metadata, storage_options=target.storage_options),
        )

    def streamed(self, history: ModuleHistory, entry: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
        """Gather the live engine's weights and write them one tensor at a time (rank 0 writes, every rank
        joins each gather), so host memory stays near one tensor; ``entry``: the weights the stage started
        with, which unchanged 16-bit values are given back as."""
        values = StreamedValues(self._module, history.original, entry)
        target, limit = self._target, self._end.max_shard_size

        def write() -> None:
            if collectives.rank() != 0:
                values.drain()
                return
            try:
                save_streamed(
                    values.specs, values.aliases, values, target.uri, max_shard_size=limit,
                    metadata=metadata, storage_options=target.storage_options,
                )
            finally:
                values.drain()  # a failed write still joins the gathers the others wait in

        collectives.all_ranks(write, "gathering and writing the handoff")
        self._report.wrote = True

    def _private_copies(
        self, values: Mapping[str, torch.Tensor], gathered: zero_engine.GatheredValues | None, mine: set[str]
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None] | None]:
        """What a background writer reads of the shards this rank writes (``mine``): copies the user cannot
        change. A master still gathered is copied by the writer's fill step (the returned callable, which
        completes the mapping before the write reads it); a value no user code reaches (a kept fp32 master) is
        read as it is; anything else the module holds is cloned now, while the job waits."""
        kept = set(gathered.kept) if gathered is not None else set()
        reachable = {t.data_ptr() for t in state_tensors(self._module).values() if t.numel()}
        clones: dict[tuple, torch.Tensor] = {}  # by the tensor's memory: tied names share one tensor, one copy
        private: dict[str, torch.Tensor] = {}
        for name in sorted(mine - kept):
            value = values.get(name)
            if value is None:
                continue
            if value.data_ptr() not in reachable:
                private[name] = value
                continue
            if _memory(value) not in clones:
                clones[_memory(value)] = value.clone()
                self._report.copied_while_waiting += value.nbytes
            private[name] = clones[_memory(value)]
        if gathered is None or not kept:
            return private, None
        end = self._end

        def fill() -> None:
            private.update(gathered.private_copies(end.private_buffers()))

        return private, fill


def _both(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        then()

    return both


def _memory(tensor: torch.Tensor) -> tuple:
    """Which memory a tensor views: the same for every name of a tied parameter, whatever object holds it."""
    if not tensor.numel():
        return (id(tensor),)
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()
