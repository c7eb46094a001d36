"""A live engine's weights read out of it: the full shape and dtype of every state-dict tensor, and
:class:`GatheredValues`, the full tensors gathered one at a time or a bucket of fp32 master partitions per
collective, copied into host memory made ready for them."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from stagesafe.zero.engine.parameters import full_shape, gathered_params, has_fp32_master, is_zero3_param, named_tensors


def full_specs(module: nn.Module) -> tuple[dict[str, tuple[torch.Size, torch.dtype]], dict[str, str]]:
    """Full shape and dtype of every state-dict tensor of a live engine's module, and the tied-name aliases."""
    params, buffers = named_tensors(module)
    specs: dict[str, tuple[torch.Size, torch.dtype]] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, param in params.items():
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
        specs[name] = (torch.Size(full_shape(param)), param.dtype)
    for name, buf in buffers.items():
        specs[name] = (buf.shape, buf.dtype)
    return specs, aliases


class GatheredValues(Mapping):
    """A live engine's full tensors by state-dict name, gathered one at a time when asked for.

    Trainable parameters come from the fp32 masters, others from their (gathered) partitions, buffers as they
    are. Each lookup of a parameter is a collective: every rank must ask for the same names in the same order.
    ``to_dtype(name, tensor)`` turns each value into what the caller wants.
    """

    def __init__(
        self,
        module: nn.Module,
        to_dtype: Callable[[str, torch.Tensor], torch.Tensor],
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        keep_for: Iterable[str] = (),
    ) -> None:
        """``into``: fp32 host tensors that a master is copied into (and returned) instead of fresh memory;
        ``keep_for``: names whose gathered masters are kept (:attr:`kept`) for a second copy of their own (a
        background writer's private one), made later by :meth:`private_copies`, off the caller's path."""
        self._params, self._buffers = named_tensors(module)
        self._to_dtype = to_dtype
        self._into = dict(into or {})
        self._keep_for = set(keep_for)
        self._devices: set[torch.device] = set()
        self.kept: dict[str, torch.Tensor] = {}  # gathered masters of ``keep_for``, until private_copies()
        self._ready: dict[str, tuple[torch.Tensor, bool]] = {}  # gathered masters, by name: (tensor, in `into`)
        self.waited = 0.0  # seconds synchronize() waited for the device: what of the end the copies' speed bounds

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._buffers:
            return self._to_dtype(name, self._buffers[name].detach().to("cpu", copy=True))
        param = self._params[name]
        ready = self._ready.pop(name, None)
        if ready is not None:  # gathered by gather_masters(): already in its host tensor, or not yet on the host
            master, placed = ready
            return master if placed else self._to_dtype(name, master.to("cpu"))
        if has_fp32_master(param):
            import deepspeed.utils

            with _quiet_collectives():
                master = deepspeed.utils.safe_get_full_fp32_param(param).detach().reshape(full_shape(param))
            placed = self._place(name, master, None)
            return self._to_dtype(name, master.to("cpu")) if placed is None else placed
        with _quiet_collectives(), gathered_params([param]):
            return self._to_dtype(name, param.data.detach().to("cpu", copy=True))

    def _place(self, name: str, master: torch.Tensor, stream: Any) -> torch.Tensor | None:
        """Copy a gathered master into its host tensor (on ``stream``, asynchronously), and keep it for a
        private copy where asked; None when it has no host tensor to go to."""
        dest = self._into.get(name)
        if dest is None or not _fits(dest, master):
            return None
        self._devices.add(master.device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dest.view(-1).copy_(master.view(-1), non_blocking=True)
        if stream is not None:
            master.record_stream(stream)
        if name in self._keep_for:
            self.kept[name] = master  # nothing writes to it now: the engine has stepped for the last time
        return dest

    def gather_masters(self, names: Iterable[str]) -> None:
        """Gather the ZeRO-3 fp32 masters of ``names`` now, a bucket of partitions per collective (instead of
        one per parameter), each bucket's copies to host memory overlapping the next bucket's gather. A
        collective: every rank calls it with the same names. Masters kept off the device (optimizer offload,
        swapping) are left to the per-parameter lookups."""
        plans = _master_buckets([(n, self._params[n]) for n in names if n in self._params])
        if not plans:
            return

        device = plans[0].flat.device
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.no_grad(), _quiet_collectives():
            for bucket in plans:
                self._gather_bucket(bucket, stream)

    def _gather_bucket(self, bucket: "_Bucket", stream: Any) -> None:
        """One collective for the bucket's partitions on every rank; each master assembled from its ranks'
        partitions (the last one's padding cut off) and sent on to its host tensor."""
        import torch.distributed as dist

        world = dist.get_world_size(group=bucket.group)
        local = bucket.flat.detach().narrow(0, bucket.start, bucket.length)
        if world == 1:  # the partition is the whole: each master a view of it, no gather, no copy on the device
            rows = local.view(1, bucket.length)
        else:
            gathered = torch.empty(world * bucket.length, dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(gathered, local, group=bucket.group)
            rows = gathered.view(world, bucket.length)
        members = self._place_batched(bucket, rows) if rows.device.type == "cpu" else bucket.members
        for name, param, offset, count in members:
            pieces = rows[:, offset - bucket.start : offset - bucket.start + count].reshape(-1)
            master = pieces[: param.ds_numel].reshape(param.ds_shape)
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(master.device))
            placed = self._place(name, master, stream)
            self._ready[name] = (master, False) if placed is None else (placed, True)

    def _place_batched(self, bucket: "_Bucket", rows: torch.Tensor) -> list:
        """Host memory: the bucket's masters that fill their ranks' partitions exactly (no padding) and have a
        host tensor go straight from the gathered rows into it, all in one batched copy (no per-master copy on
        the way); those of ``keep_for`` get copies of their own, from one buffer. Returns the other members."""
        world = rows.shape[0]
        rest, dests, sources, placed = [], [], [], []
        for member in bucket.members:
            name, param, offset, count = member
            dest = self._into.get(name)
            if dest is None or world * count != param.ds_numel or not _fits_numel(dest, rows.dtype, param.ds_numel):
                rest.append(member)
                continue
            start = offset - bucket.start
            dests.append(dest.view(world, count))
            sources.append(rows[:, start : start + count])
            placed.append((name, dest))
        if not placed:
            return rest
        torch._foreach_copy_(dests, sources)
        kept = [(name, dest) for name, dest in placed if name in self._keep_for]
        if kept:  # a copy of their own, as a master gathered one at a time is: one allocation, one batched copy
            buffer = torch.empty(sum(d.numel() for _, d in kept), dtype=rows.dtype)
            copies = torch.split(buffer, [d.numel() for _, d in kept])
            torch._foreach_copy_(list(copies), [d.view(-1) for _, d in kept])
            self.kept.update((name, copy.view(dest.shape)) for (name, dest), copy in zip(kept, copies))
        self._ready.update((name, (dest, True)) for name, dest in placed)
        return rest

    def synchronize(self) -> None:
        """Wait for the copies into ``into`` (asynchronous into page-locked memory) and the gathers."""
        start = time.perf_counter()
        for device in self._devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        self.waited += time.perf_counter() - start

    def private_copies(self, into: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The kept masters as copies of their own, by name, and let the masters go: a master on the CPU is one
        already (gathered into memory of its own, no user code reaches it); one on a GPU is copied into its host
        tensor of ``into`` (where it has none, into memory allocated here). In a background writer, after
        :meth:`synchronize`; on a GPU the copies run on a stream of their own, so that they neither wait for nor
        hold up the next stage's work on the default stream."""
        kept, self.kept = self.kept, {}
        copies = {name: master for name, master in kept.items() if master.device.type != "cuda"}
        streams = {device: torch.cuda.Stream(device) for device in {m.device for m in kept.values()}
                   if device.type == "cuda"}
        for name, master in kept.items():
            stream = streams.get(master.device)
            if stream is None:
                continue
            dest = into.get(name)
            if dest is None or not _fits(dest, master):
                dest = torch.empty(master.shape, dtype=master.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                dest.view(-1).copy_(master.view(-1), non_blocking=True)
            copies[name] = dest.view(master.shape)
        for stream in streams.values():
            stream.synchronize()
        return copies

    def __iter__(self) -> Iterator[str]:
        return iter([*self._params, *self._buffers])

    def __len__(self) -> int:
        return len(self._params) + len(self._buffers)


@contextlib.contextmanager
def _quiet_collectives() -> Iterator[None]:
    """torch.distributed warns that the collectives DeepSpeed and this file call are deprecated, once per call;
    those warnings say nothing to the user about their own code, so they are left out here, and only here."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
        yield


_BUCKET_NUMEL = 256 * 2**20  # fp32 elements of one rank's partitions gathered per collective (1 GiB)


@dataclass
class _Bucket:
    """Consecutive fp32 master partitions of one optimizer sub-group, gathered by one collective."""

    flat: torch.Tensor  # this rank's flat fp32 partition of the sub-group
    group: Any  # the parameters' partition process group
    start: int
    length: int
    members: list[tuple[str, nn.Parameter, int, int]]  # name, parameter, offset in the flat, partition numel


def _master_buckets(named: list[tuple[str, nn.Parameter]]) -> list[_Bucket]:
    """Buckets of ZeRO-3 masters that live on the device in the optimizer's flat partitions (the same on every
    rank: built from the optimizer's layout, not from this rank's values)."""
    by_group: dict[tuple[int, int], list[tuple[str, nn.Parameter, int, int]]] = {}
    flats: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}
    seen: set[int] = set()
    for name, param in named:
        if id(param) in seen or not is_zero3_param(param) or not has_fp32_master(param):
            continue
        seen.add(id(param))
        optimizer = param._z3_optimizer
        index, offset, count = optimizer.grad_position[optimizer.get_param_id(param)]
        if getattr(optimizer, "offload_optimizer", False) or optimizer._swappable_optimizer_subgroup(index):
            continue
        key = (id(optimizer), int(index))
        if key not in flats:
            stream = getattr(optimizer, "reduce_and_partition_stream", None)
            if stream is not None:
                stream.synchronize()  # the last step's updates are in the flat partition
            flats[key] = (optimizer.fp32_partitioned_groups_flat[index], optimizer._get_param_partition_group(param))
        by_group.setdefault(key, []).append((name, param, int(offset), int(count)))
    buckets = []
    for key, members in by_group.items():
        flat, group = flats[key]
        members.sort(key=lambda m: m[2])
        current: list = []
        for member in members:
            if current and member[2] + member[3] - current[0][2] > _BUCKET_NUMEL:
                buckets.append(_bucket(flat, group, current))
                current = []
            current.append(member)
        if current:
            buckets.append(_bucket(flat, group, current))
    return buckets


def _bucket(flat: torch.Tensor, group: Any, members: list) -> _Bucket:
    start = members[0][2]
    return _Bucket(flat=flat, group=group, start=start, length=members[-1][2] + members[-1][3] - start, members=members)


def _fits(dest: torch.Tensor, master: torch.Tensor) -> bool:
    return _fits_numel(dest, master.dtype, master.numel())


def _fits_numel(dest: torch.Tensor, dtype: torch.dtype, numel: int) -> bool:
    return dest.device.type == "cpu" and dest.dtype == dtype and dest.numel() == numel and dest.is_contiguous()
