"""A live engine's optimizer state read out per parameter, for the form that no number of ranks is written into.

The inverse of :func:`~stagesafe.zero.engine.checkpoint_load.load_optimizer_state`: where that fills this rank's
flat partitions parameter by parameter, :func:`describe_optimizer` says what the engine's optimizer holds (the
keys held per element, such as Adam's ``exp_avg`` and ``exp_avg_sq``; the one-value state of each param group,
``step``; the hyperparameters; the loss scaler), all as plain JSON values, and :class:`StateGather` gathers the
full per-parameter tensors of a bucket of ``(key, parameter)`` names onto rank 0: each rank sends the slices of
its flat partitions that hold them (their places known from :func:`partition_layout`), bytes as they are, in one
``gather`` per bucket. No rank ever holds more than one bucket of the state beyond its own partitions.
Optimizer state that is neither per element nor one value per group is refused before anything is gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stagesafe.errors import CheckpointFormatError, InvalidArgumentError, shown
from stagesafe.zero.engine.checkpoint_load import FlatPartition, _bf16, _trained_parameters, _zero3, partition_layout

__all__ = ["EngineOptimizer", "StateGather", "describe_optimizer"]


@dataclass(frozen=True)
class EngineOptimizer:
    """What a live engine's optimizer holds, as the form beside a handoff writes it (plain values only)."""

    keys: list[str]  # held per element of the parameters
    trained: list[tuple[str, tuple[int, ...], int]]  # (name, full shape, param group), tied weights once
    hyperparameters: list[dict[str, Any]]  # per param group, ``params`` left out
    values: list[dict[str, dict[str, Any]]]  # per param group: its one-value state, ``{"dtype"?, "value"}``
    loss_scaler: dict[str, Any] | None


def _flats(engine: Any) -> list[torch.Tensor]:
    """This rank's flat fp32 partitions, in :func:`partition_layout`'s order: what the torch optimizer keys by."""
    optimizer = engine.optimizer
    if _zero3(engine):
        return list(optimizer.fp32_partitioned_groups_flat)
    return list(optimizer.fp32_groups_flat_partition if _bf16(engine) else optimizer.single_partition_of_fp32_groups)


def _check_engine(engine: Any) -> None:
    optimizer = engine.optimizer
    if engine.zero_nvme_offload_optimizer() or getattr(optimizer, "swap_optimizer", False):
        raise InvalidArgumentError(
            "handoff_optimizer_state=True: this engine swaps its optimizer state to NVMe, which stagesafe does not "
            "read; leave the argument False and save a checkpoint (trainer.save_checkpoint) instead"
        )


def describe_optimizer(engine: Any) -> EngineOptimizer:
    """The keys, param groups and one-value state of the engine's optimizer, read on this rank (no collective).
    Raises :class:`CheckpointFormatError` for state that is not per parameter (a key of another size than the
    partition, a value that JSON cannot hold)."""
    _check_engine(engine)
    base = engine.optimizer.optimizer
    layout, flats = partition_layout(engine), _flats(engine)
    keys: set[str] | None = None
    first_of_group: dict[int, dict[str, Any]] = {}
    for part, flat in zip(layout, flats):
        state = base.state.get(flat, {})
        element = {k for k, v in state.items() if _per_element(v, flat)}
        for key, value in state.items():
            if key not in element and not _one_value(value):
                what = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else shown(value, 60)
                raise CheckpointFormatError(
                    f"the optimizer state {key!r} ({type(base).__name__}) is {what}, neither one value per element "
                    "of the parameters nor one value per group, so it cannot be written per parameter; only "
                    "optimizers whose state is per-parameter tensors (Adam, AdamW, SGD with momentum, ...) can. "
                    "Leave handoff_optimizer_state=False"
                )
        if keys is not None and element != keys:
            raise CheckpointFormatError(
                f"the optimizer holds {sorted(element)} per element in one partition, {sorted(keys)} in another; "
                "it cannot be written per parameter"
            )
        keys = element
        first_of_group.setdefault(part.group, {k: v for k, v in state.items() if k not in element})
    hyper = [{str(k): _plain(v, f"hyperparameter {k!r} of param group {i}") for k, v in g.items() if k != "params"}
             for i, g in enumerate(base.param_groups)]
    values = [{str(k): _plain_held(v, f"optimizer state {k!r} of param group {g}") for k, v in
               first_of_group.get(g, {}).items()} for g in range(len(hyper))]
    return EngineOptimizer(sorted(keys or ()), _trained_parameters(engine), hyper, values,
                           _loss_scaler(getattr(engine.optimizer, "loss_scaler", None)))


def _per_element(value: Any, flat: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == flat.numel() and value.numel() > 1


def _one_value(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) or value.numel() == 1


def _plain(value: Any, what: str) -> Any:
    """``value`` as a JSON value: a one-element tensor as its number, tuples as lists; anything else refused."""
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise CheckpointFormatError(f"{what} is {value!r}, which JSON cannot hold")
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{what}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        number = value.detach().to("cpu", torch.float32 if value.dtype in (torch.bfloat16, torch.float16) else None)
        return _plain(number.item(), what)
    raise CheckpointFormatError(
        f"{what} is {shown(value, 80)}, not a number, string or list of them; the optimizer's state cannot be "
        "written as plain values. Leave handoff_optimizer_state=False"
    )


def _plain_held(value: Any, what: str) -> dict[str, Any]:
    """A one-value state as the form holds it: a tensor as ``{"dtype", "value"}``, else ``{"value"}``."""
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "value": _plain(value, what)}
    return {"value": _plain(value, what)}


def _loss_scaler(scaler: Any) -> dict[str, Any] | None:
    """The loss scaler's class and plain attributes (its scale and counters), as a checkpoint's pickle names them."""
    if scaler is None:
        return None
    cls = type(scaler)
    attributes = {str(k): v for k, v in vars(scaler).items() if type(v) in (int, float, bool)}
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "attributes": attributes}


class StateGather:
    """Full per-parameter optimizer state, gathered onto rank 0 a bucket at a time (every rank calls
    :meth:`bucket` with the same names, in the same order: each is a collective). Made once per engine: every
    rank's layout is exchanged then (names and element ranges only)."""

    def __init__(self, engine: Any, described: EngineOptimizer) -> None:
        import torch.distributed as dist

        self._engine = engine
        self._layout: list[FlatPartition] = partition_layout(engine)
        self._flats = _flats(engine)
        base = engine.optimizer.optimizer
        self._states = [base.state.get(flat, {}) for flat in self._flats]
        self._shapes = {name: shape for name, shape, _ in described.trained}
        mine = [(p, name, offset, first, count) for p, part in enumerate(self._layout)
                for name, offset, first, count in part.slices]
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        everyone: list = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        self._slices: list[dict[str, list[tuple[int, int, int, int]]]] = []  # rank -> name -> [(p, off, first, n)]
        for slices in everyone:
            by_name: dict[str, list[tuple[int, int, int, int]]] = {}
            for p, name, offset, first, count in slices:
                by_name.setdefault(name, []).append((p, offset, first, count))
            for pieces in by_name.values():
                pieces.sort(key=lambda piece: piece[2])
            self._slices.append(by_name)
        self.device = self._flats[0].device if self._flats else torch.device("cpu")

    def bucket(self, names: Sequence[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor] | None:
        """The full fp32 tensors of ``names`` (``(key, parameter)`` pairs) on rank 0, in host memory; None on
        the other ranks. A collective."""
        import torch.distributed as dist

        lengths = [sum(n for key, name in names for *_, n in self._slices[r].get(name, ())) for r in range(self.world)]
        size = max(lengths, default=0)
        send = torch.empty(size, dtype=torch.float32, device=self.device)
        at = 0
        for key, name in names:
            for p, offset, _, count in self._slices[self.rank].get(name, ()):
                send.narrow(0, at, count).copy_(self._states[p][key].detach().view(-1).narrow(0, offset, count))
                at += count
        if self.world > 1:
            rows = [torch.empty_like(send) for _ in range(self.world)] if self.rank == 0 else None
            dist.gather(send, rows, dst=0)
        else:
            rows = [send]
        if self.rank != 0:
            return None
        host = [row.to("cpu") for row in rows]
        out = {(key, name): torch.empty(self._shapes[name], dtype=torch.float32) for key, name in names}
        for r, row in enumerate(host):
            at = 0
            for key, name in names:
                flat = out[(key, name)].view(-1)
                for _, _, first, count in self._slices[r].get(name, ()):
                    flat.narrow(0, first, count).copy_(row.narrow(0, at, count))
                    at += count
        self._check_whole(names)
        return out

    def _check_whole(self, names: Sequence[tuple[str, str]]) -> None:
        """Every element of each parameter came from exactly one rank (an internal invariant of the layouts)."""
        for _, name in names:
            numel = 1
            for d in self._shapes[name]:
                numel *= int(d)
            covered = sum(n for r in range(self.world) for *_, n in self._slices[r].get(name, ()))
            if covered != numel:
                raise RuntimeError(
                    f"stagesafe: the ranks' optimizer partitions hold {covered} elements of {name!r}, which has "
                    f"{numel}; this is a bug in stagesafe: please report it"
                )

