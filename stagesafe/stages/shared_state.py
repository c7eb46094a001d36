"""The kept optimizer state, whole per parameter, shared by the ranks of one host after a fit.

Under ZeRO-3 a rank holds only its partition of each parameter's per-element optimizer state (Adam's moments), so
it cannot give the user's optimizer what stock's holds, each parameter's state of the parameter's shape. Where
every rank of the job runs on one host, they lay that state out once per host, per parameter, in host memory they
share (:class:`~stagesafe.stages.shared_region.SharedRegion`): each rank writes its slices there and lets go of its
flat partitions, which its kept checkpoint files then hold as :class:`~stagesafe.zero.engine.HeldPartition` (built
again from the shared values when a checkpoint is written). The given-back optimizer's state is views into it.

Host memory: the state once per host (8 bytes per parameter for Adam's two fp32 moments), where the ranks' flat
partitions held it before (the same 8 bytes per parameter, over the ranks); while a rank writes, its partition of
one moment's flat partition is held twice at most. Each rank reads the shared pages through its own copy-on-write
mapping, so that a ``step()`` on one rank's views changes its state alone (its pages are then its own copy).
Several hosts: nothing is shared, the state stays in the flat partitions and the given-back optimizer's is empty.

:func:`share_moments` agrees on it (every rank calls it: collectives), :meth:`SharedMoments.fill` writes this rank's
part once its kept files are on the host (no collective: it may run in the writer's device thread), and
:meth:`SharedMoments.ready` tells whether every rank has.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stagesafe.stages import collectives
from stagesafe.stages.shared_region import FAILED, WRITTEN, SharedRegion
from stagesafe.zero import engine as zero_engine

__all__ = ["SharedMoments", "share_moments"]

log = logging.getLogger(__name__)

_ALIGN = 64

# (parameter name, state key) -> (byte offset in the region, full shape, dtype)
Layout = dict[tuple[str, str], tuple[int, torch.Size, torch.dtype]]


@dataclass
class SharedMoments:
    """One rank's side of the shared state: the region, where each parameter's state lies in it, and this
    rank's slices of each flat partition (``places.flats``)."""

    region: SharedRegion
    rank: int
    places: zero_engine.StatePlaces
    layout: Layout

    def fill(self, files: Mapping[str, Mapping[str, Any]]) -> None:
        """Write this rank's slices of every per-element state into the region, and hold each flat partition
        in ``files`` as a :class:`~stagesafe.zero.engine.HeldPartition` of the shared values instead (its
        padding, which no parameter's value holds, kept beside). The files' tensors must be on the host. A
        failure is marked, so that no rank waits for this one, and raised."""
        try:
            numbered = zero_engine.numbered_state(files, self.places.file)
            if numbered is None:
                raise ValueError(f"the kept file {self.places.file!r} holds no optimizer state by number")
            shared, private = self.region.shared(), self.region.private()
            for flat in self.places.flats:
                state = numbered.get(flat.number)
                for key in _element_keys(state, flat.numel):
                    state[key] = self._held(flat, key, state[key], shared, private)
        except BaseException:
            self.region.mark(self.rank, FAILED)
            raise
        self.region.mark(self.rank, WRITTEN)

    def give_up(self) -> None:
        """This rank will not write its part (its kept state could not be copied): no rank waits for it."""
        if self.region.states()[self.rank] != WRITTEN:
            self.region.mark(self.rank, FAILED)

    def ready(self, timeout: float) -> bool:
        """Whether every rank has written its part, waiting ``timeout`` seconds at most."""
        return self.region.wait(timeout)

    def _held(
        self, flat: zero_engine.FlatSlices, key: str, tensor: torch.Tensor, shared: torch.Tensor,
        private: torch.Tensor,
    ) -> zero_engine.HeldPartition:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"the kept state {key!r} of partition {flat.number} is not a contiguous host tensor")
        source = tensor.detach().view(-1)
        for name, offset, first, count in flat.slices:
            _value(shared, self.layout[(name, key)]).view(-1).narrow(0, first, count).copy_(
                source.narrow(0, offset, count))
        padding = tuple((start, source.narrow(0, start, end - start).clone()) for start, end in _gaps(flat))
        recipe = zero_engine.PartitionRecipe(flat.numel, tensor.dtype, flat.slices, padding)
        values = {place.name: _value(private, self.layout[(place.name, key)])  # a rank may hold none of one's
                  for place in self.places.places if place.number == flat.number}
        return zero_engine.HeldPartition(recipe, values)


def share_moments(files: Mapping[str, Mapping[str, Any]] | None, places: zero_engine.StatePlaces) -> SharedMoments | None:
    """Every rank calls it at a fit's end, with its kept checkpoint ``files`` (their tensors may still be on the
    device) and where the state lies in them (``places`` with this rank's ``flats``). Returns this rank's side of
    a shared region laid out for every parameter's per-element state, or None on every rank where it is not
    made: ranks on several hosts, a rank without kept files, no per-element state (no step yet), ranks that do
    not agree on the state's keys, shapes or dtypes, or a region not made or opened (said in the log)."""
    what = "sharing the kept optimizer state between the ranks of this host"
    made: list[SharedRegion] = []
    try:
        reports = collectives.gather_all(lambda: _report(files, places), what)
        layout, nbytes = _agreed_layout(reports)
        if layout is None:
            return None
        rank, ranks = collectives.rank(), collectives.world_size()

        def create() -> tuple[int, int]:
            made.append(SharedRegion.create(nbytes, ranks))
            return os.getpid(), made[0].fd

        pid, fd = collectives.on_rank_zero(create, what)

        def open_it() -> None:
            if rank != 0:
                made.append(SharedRegion.open(pid, fd, nbytes, ranks))

        collectives.gather_all(open_it, what)  # every rank has opened it, or every rank raises
        made[0].close_fd()
        return SharedMoments(made[0], rank, places, layout)
    except Exception as exc:  # noqa: BLE001 - every rank gets here alike (the collectives raise on all of them)
        for region in made:
            region.close_fd()
        log.warning("stagesafe: %s failed (%s): after this fit trainer.optimizers[0].state stays empty (the state is "
                    "kept, and a checkpoint holds it; docs/troubleshooting.md#empty-optimizer-state)", what, exc)
        return None


def _report(files: Mapping[str, Mapping[str, Any]] | None, places: zero_engine.StatePlaces) -> tuple[Any, ...]:
    """This rank's host, and each parameter's per-element state as (name, key, shape, dtype), or None."""
    numbered = zero_engine.numbered_state(files, places.file) if files is not None else None
    if numbered is None:
        return _host(), None
    keys: dict[int, list[tuple[str, str]]] = {}
    for flat in places.flats:
        state = numbered.get(flat.number)
        element = _element_keys(state, flat.numel)
        if isinstance(state, Mapping) and any(isinstance(value, torch.Tensor) and value.dim() > 0 and key not in element
                                              for key, value in state.items()):
            return _host(), None  # a state of several values not laid out as the flat partition
        keys[flat.number] = [(key, str(state[key].dtype).removeprefix("torch.")) for key in element]
    signature = [(place.name, key, tuple(place.shape), dtype)
                 for place in places.places for key, dtype in keys.get(place.number, [])]
    return _host(), signature


def _agreed_layout(reports: list[tuple[Any, ...]]) -> tuple[Layout | None, int]:
    """Each (name, key)'s place in the region, where every rank is on this host with the same signature."""
    hosts = {host for host, _ in reports}
    signatures = [signature for _, signature in reports]
    if len(hosts) != 1 or any(s is None for s in signatures) or any(s != signatures[0] for s in signatures):
        return None, 0
    if not signatures[0]:
        return None, 0  # no per-element state: as stock, an empty state
    layout: Layout = {}
    at = 0
    for name, key, shape, dtype in signatures[0]:
        size = torch.Size(shape)
        dtype_ = getattr(torch, dtype)
        layout[(name, key)] = (at, size, dtype_)
        at += -(-size.numel() * dtype_.itemsize // _ALIGN) * _ALIGN
    return layout, at


def _host() -> str:
    """This machine, told apart from another of the same name by its boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _element_keys(state: Any, numel: int) -> list[str]:
    """The keys of a flat partition's state that hold a value per element (not a step count)."""
    if not isinstance(state, Mapping):
        return []
    return [key for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel]


def _value(region: torch.Tensor, place: tuple[int, torch.Size, torch.dtype]) -> torch.Tensor:
    at, shape, dtype = place
    return region.narrow(0, at, shape.numel() * dtype.itemsize).view(dtype).view(shape)


def _gaps(flat: zero_engine.FlatSlices) -> list[tuple[int, int]]:
    """The flat partition's elements no slice holds (the last ranks' padding), as (start, end)."""
    gaps, at = [], 0
    for _, offset, _, count in sorted(flat.slices, key=lambda s: s[1]):
        if offset > at:
            gaps.append((at, offset))
        at = max(at, offset + count)
    if at < flat.numel:
        gaps.append((at, flat.numel))
    return gaps
