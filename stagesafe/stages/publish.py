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

from stagesafe.handoff.plan import plan_handoff
from stagesafe.handoff.save import save_state_dict, save_streamed
from stagesafe.stages import collectives
from stagesafe.stages.end_memory import EndMemory
from stagesafe.stages.engine_weights import StreamedValues
from stagesafe.stages.history import HandoffTarget, ModuleHistory, state_tensors
from stagesafe.stages.host import HostBuffers
from stagesafe.stages.writer import HandoffWriter, WriteRequest
from stagesafe.zero import engine as zero_engine

__all__ = ["HandoffPublisher", "handoff_metadata"]


def handoff_metadata(history: ModuleHistory) -> dict[str, Any]:
    """The handoff's metadata: where its weights come from, and the module's original dtypes."""
    dtypes = {n: str(dtype).removeprefix("torch.") for n, (dtype, _) in history.original.items()}
    return {**history.weights_from, "original_dtypes": dtypes}


class HandoffPublisher:
    """Has one boundary's weights written to its ``target`` (every rank calls each method, in step).

    ``report``: the boundary's :class:`~stagesafe.stages.boundary.BoundaryReport`, which gets ``wrote``,
    ``handoff_bytes``, ``copied_while_waiting`` and the writer's phases. ``memory``: the stage's host memory,
    which knows which names this rank writes.
    """

    def __init__(
        self, module: nn.Module, target: HandoffTarget, writer: HandoffWriter, memory: EndMemory, report: Any
    ) -> None:
        self._module = module
        self._target = target
        self._writer = writer
        self._memory = memory
        self._report = report

    def start(
        self,
        history: ModuleHistory,
        values: Mapping[str, torch.Tensor],
        tensors: Mapping[str, torch.Tensor],
        *,
        gathered: zero_engine.GatheredValues | None,
        host: HostBuffers | None,
        background: bool,
        keep: Callable[[], None] | None = None,
    ) -> None:
        """Start the writer on ``values``, which the module's ``tensors`` hold. A write that may outlast the
        call (``background``) reads private copies of the shards this rank writes. ``keep``: device work of
        the boundary's own for the writer's device thread, after those copies (the kept optimizer state's)."""
        self._report.wrote = True
        self._report.handoff_bytes = sum({id(v): v.nbytes for v in values.values()}.values())
        private, fill = self._private_copies(values, gathered) if background else (values, None)
        request = WriteRequest(
            values=private,
            uri=self._target.uri,
            storage_options=self._target.storage_options,
            max_shard_size=self._target.max_shard_size,
            metadata=handoff_metadata(history),
            fill=fill,
            unlock=host.unlock if host is not None else None,
            phases=self._report.phases,
            on_failed=history.lost,
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
            lambda: save_state_dict(values, target.uri, max_shard_size=target.max_shard_size, overwrite=True,
                                    metadata=metadata, storage_options=target.storage_options),
            target.uri,
        )

    def streamed(self, history: ModuleHistory, entry: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
        """Gather the live engine's weights and write them one tensor at a time (rank 0 writes, every rank
        joins each gather), so host memory stays near one tensor; ``entry``: the weights the stage started
        with, which unchanged 16-bit values are given back as."""
        values = StreamedValues(self._module, history.original, entry)
        target = self._target

        def write() -> None:
            if collectives.rank() != 0:
                values.drain()
                return
            try:
                save_streamed(
                    values.specs, values.aliases, values, target.uri, max_shard_size=target.max_shard_size,
                    metadata=metadata, storage_options=target.storage_options,
                )
            finally:
                values.drain()  # a failed write still joins the gathers the others wait in

        collectives.all_ranks(write, "gathering and writing the handoff")
        self._report.wrote = True

    def _private_copies(
        self, values: Mapping[str, torch.Tensor], gathered: zero_engine.GatheredValues | None
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None] | None]:
        """What a background writer reads: for the shards this rank writes, private copies the user cannot
        change (those the writer fills from the gathered masters, clones of the rest, made now, while the job
        waits); the other names as they are. Also the writer's fill step."""
        mine = self._memory.written_here
        if mine is None:  # a stage whose end was not planned for (no host memory was prepared)
            plan = plan_handoff(values, max_shard_size=self._target.max_shard_size)
            mine = self._memory.plan_writes(plan.tensors, plan.aliases)
        copied = gathered.copied if gathered is not None else {}
        reachable = {t.data_ptr() for t in state_tensors(self._module).values() if t.numel()}
        copies: dict[tuple, torch.Tensor] = {}  # by the tensor's memory: tied names share one tensor, one copy
        private = dict(values)
        for name in mine:
            value = values.get(name)
            if value is None or (value.data_ptr() not in reachable and name not in copied):
                continue  # a kept fp32 master: no user code can change it
            if _memory(value) not in copies:
                if name in copied:
                    copies[_memory(value)] = copied[name]
                else:
                    copies[_memory(value)] = value.clone()
                    self._report.copied_while_waiting += value.nbytes
            private[name] = copies[_memory(value)]
        for name, value in values.items():  # a tied name (planned under its first one) reads the same copy
            private[name] = copies.get(_memory(value), private[name])
        return private, (gathered.fill_copies if gathered is not None else None)


def _memory(tensor: torch.Tensor) -> tuple:
    """Which memory a tensor views: the same for every name of a tied parameter, whatever object holds it."""
    if not tensor.numel():
        return (id(tensor),)
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()
