"""DeepSpeed's broadcasts of a plain module's parameters while it builds an engine, one per bucket of parameters
instead of one per parameter.

A ZeRO-3 engine built over a module of plain tensors broadcasts every parameter from the first rank twice, one
collective each: in ``DeepSpeedEngine._broadcast_model`` and again as ``zero.Init`` partitions it
(``Init._convert_to_zero_parameters``). stagesafe hands every stage such a module, so a module of 20,000 small
tensors paid 40,000 collectives per Trainer call (about 30 s on two CPU ranks). :func:`flat_broadcasts` does the
same broadcasts, from the same rank over the same group, a bucket of up to 64 MiB of parameters per collective:
every rank ends with the first rank's bits, as before. Anything it does not know (expert parallel parameters,
an ``Init`` subclass with its own per-parameter step) goes through DeepSpeed's own code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["flat_broadcasts"]

_BUCKET_BYTES = 64 * 2**20


@contextlib.contextmanager
def flat_broadcasts() -> Iterator[None]:
    """While the block builds engines: DeepSpeed's per-parameter broadcasts of a plain module, a bucket per
    collective. Every rank enters (the broadcasts are collectives, in the same order on every rank)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init

    own_broadcast, own_convert = DeepSpeedEngine._broadcast_model, Init._convert_to_zero_parameters

    def broadcast_model(engine: Any) -> None:
        if not _broadcast_model(engine):
            own_broadcast(engine)

    def convert(init: Any, param_list: Any) -> None:
        if type(init)._zero_init_param is not Init._zero_init_param:
            own_convert(init, param_list)
        else:
            _convert_to_zero_parameters(init, param_list)

    DeepSpeedEngine._broadcast_model, Init._convert_to_zero_parameters = broadcast_model, convert
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model, Init._convert_to_zero_parameters = own_broadcast, own_convert


def _broadcast_model(engine: Any) -> bool:
    """``DeepSpeedEngine._broadcast_model``, a bucket per collective; False (nothing done) for a module with
    expert parallel parameters, whose groups are per parameter."""
    import deepspeed.comm as dist
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import groups

    if engine.dist_backend is None:
        return True
    params = [p for _, p in engine.module.named_parameters()]
    if any(is_moe_param(p) for p in params):
        return False

    def replicated(p: torch.Tensor) -> bool:  # DeepSpeed's own test
        if hasattr(p, "ds_status") and p.ds_status is not ZeroParamStatus.AVAILABLE:
            return False
        return not hasattr(p, "ds_optim_param")

    tensors = [p.data for p in params if torch.is_tensor(p) and replicated(p)]
    _broadcast_bucketed(tensors, groups._get_broadcast_src_rank(), engine.seq_data_parallel_group, dist)
    return True


def _convert_to_zero_parameters(init: Any, param_list: Any) -> None:
    """``Init._convert_to_zero_parameters``: each parameter moved to the local device and made a ZeRO-3 parameter
    in order, then broadcast from its partition group's first rank a bucket at a time, then partitioned (so the
    full parameters of one bucket at most are on the device at once)."""
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    bucket: list[torch.nn.Parameter] = []
    pending = 0
    for param in param_list:
        if is_zero_param(param):
            continue
        param.data = param.data.to(init.local_device)
        init._convert_to_deepspeed_param(param)
        bucket.append(param)
        pending += param.data.numel() * param.data.element_size()
        if pending >= _BUCKET_BYTES:
            _partition_bucket(init, bucket)
            bucket, pending = [], 0
    _partition_bucket(init, bucket)


def _partition_bucket(init: Any, params: list[torch.nn.Parameter]) -> None:
    import deepspeed.comm as dist

    by_group: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for param in params:
        group = init.get_partition_dp_group(param)
        by_group.setdefault(id(group), (group, []))[1].append(param.data)
    for group, tensors in by_group.values():
        source = 0 if dist.get_world_group() == group else dist.get_global_rank(group, 0)
        _broadcast_bucketed(tensors, source, group, dist)
    for param in params:
        param.partition()


def _broadcast_bucketed(tensors: list[torch.Tensor], source: int, group: Any, dist: Any) -> None:
    """Broadcast the tensors' bytes from ``source``: one collective per device and bucket of up to 64 MiB (one
    per tensor for a tensor that is not contiguous, as DeepSpeed does)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.is_contiguous():
            by_device.setdefault(tensor.device, []).append(tensor)
        else:
            dist.broadcast(tensor.view(torch.uint8), source, group=group)
    for same_device in by_device.values():
        start, pending = 0, 0
        for end, tensor in enumerate(same_device, 1):
            pending += tensor.numel() * tensor.element_size()
            if pending >= _BUCKET_BYTES or end == len(same_device):
                _broadcast_flat(same_device[start:end], source, group, dist)
                start, pending = end, 0


def _broadcast_flat(tensors: list[torch.Tensor], source: int, group: Any, dist: Any) -> None:
    """One collective for the tensors' bytes; on the other ranks each tensor takes its slice of them."""
    views = [t.view(-1).view(torch.uint8) for t in tensors]
    if len(views) == 1:
        dist.broadcast(views[0], source, group=group)
        return
    flat = torch.cat(views)
    dist.broadcast(flat, source, group=group)
    if dist.get_rank() != source:
        with torch.no_grad():
            torch._foreach_copy_(views, list(torch.split(flat, [v.numel() for v in views])))
