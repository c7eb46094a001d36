"""Weights put into an engine: a module placed on the engine's device and cast beside zero.Init's parameters
before it is built, a module on the meta device given its ZeRO-3 partitions straight from values, a full state dict
loaded into a live engine's 16-bit partitions, and the optimizer's fp32 masters set bit for bit."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from stagesafe.zero.engine.parameters import gathered_params, has_fp32_master, is_zero3_param, named_tensors


def place_for_engine(module: nn.Module, device: torch.device) -> bool:
    """Move a module no engine has partitioned to the CUDA device its engine will compute on, before the engine is
    built; whether it did. DeepSpeed casts a module to its 16-bit dtype where the module is, then moves it: from
    the CPU that is a second host copy of the weights, 2 bytes per parameter, while the caller still holds the
    fp32 ones. On the device the cast costs no host memory (and the module goes there next anyway)."""
    if device.type != "cuda":
        return False
    tensors = [*module.parameters(), *module.buffers()]
    if not tensors or any(is_zero3_param(p) for p in module.parameters()):
        return False  # zero.Init placed its parameters; DeepSpeed moves nothing of such a module either
    if any(t.device.type == "meta" for t in tensors):
        return False
    module.to(device)
    return True


def cast_beside_zero_init(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast to the engine's 16-bit ``dtype`` the floating-point parameters zero.Init did not build, in a module
    where it built others (``configure_model`` beside ``__init__``). DeepSpeed casts a module's parameters only
    where zero.Init built none of them, so those built in ``__init__`` stayed fp32 and the first forward failed
    ("mat1 and mat2 must have the same dtype"). The cast is DeepSpeed's for a plain module: the caller keeps the
    fp32 values, which become the engine's masters."""
    params = list(module.parameters())
    if dtype not in (torch.bfloat16, torch.float16) or not any(is_zero3_param(p) for p in params):
        return
    for param in params:
        if not is_zero3_param(param) and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def partition_from_values(
    module: nn.Module,
    values: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Give a module on the meta device its ZeRO-3 partitions straight from ``values``, one submodule at a time.

    Deepest submodules first: a submodule's own parameters are built from ``values`` in the engine's ``dtype``,
    partitioned at once (DeepSpeed's ``zero.Init`` conversion), and their full copies freed, so host memory holds
    one submodule's weights (plus whatever ``values`` caches). Buffers go to ``device``. The engine built next
    adopts the partitioned parameters as a ZeRO-Init model.
    """
    import deepspeed

    converted: nn.Parameter | None = None
    done: dict[int, nn.Parameter] = {}
    for prefix, sub in reversed(list(module.named_modules(remove_duplicate=False))):
        fresh = []
        for local_name, param in list(sub._parameters.items()):
            if param is None:
                continue
            if id(param) in done:
                sub._parameters[local_name] = done[id(param)]
                continue
            name = f"{prefix}.{local_name}" if prefix else local_name
            value = values[name].to(dtype=dtype if param.is_floating_point() else param.dtype)
            new = nn.Parameter(value, requires_grad=param.requires_grad)
            done[id(param)] = sub._parameters[local_name] = new
            fresh.append(new)
        if fresh:
            if converted is None:
                deepspeed.zero.Init(module=sub, config_dict_or_path=dict(config), dtype=dtype)
                converted = fresh[0]
            else:
                converted.convert_to_zero_parameters(param_list=fresh)
        for local_name, buf in list(sub._buffers.items()):
            name = f"{prefix}.{local_name}" if prefix else local_name
            if buf is not None and buf.device.type == "meta" and name in values:
                sub._buffers[local_name] = values[name].to(device=device, dtype=buf.dtype)


def set_fp32_masters(module: nn.Module, values: Mapping[str, torch.Tensor]) -> int:
    """Make the optimizer's fp32 master weights equal ``values`` bit for bit; returns how many were set.

    DeepSpeed builds its masters from the module after casting it to 16 bits, which rounds them; this puts
    the exact values back. Purely local: each rank writes its own partition.
    """
    import deepspeed.utils

    count = 0
    seen: set[int] = set()
    zero3: list[tuple[nn.Parameter, str]] = []
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen or not has_fp32_master(param) or name not in values:
            continue
        seen.add(id(param))
        if is_zero3_param(param):
            zero3.append((param, name))
        else:
            value = values[name].detach().to(device=param.device, dtype=torch.float32)
            deepspeed.utils.safe_set_full_fp32_param(param, value)
        count += 1
    _set_zero3_masters(zero3, values)
    return count


def _set_zero3_masters(named: list[tuple[nn.Parameter, str]], values: Mapping[str, torch.Tensor]) -> None:
    """Write this rank's slice of each parameter's value into its fp32 master partition. The partitions that hold no
    padding and live in a flat partition in memory (not swapped out) are written by one batched copy per
    call of up to 64 MiB (``values`` may be a lazy reader: what a batch holds is bounded); the others one at a
    time (:func:`_set_zero3_master`)."""
    destinations: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    flats: dict[tuple[int, int], tuple[torch.Tensor, int] | None] = {}
    pending = 0
    for param, name in named:
        value = values[name]
        optimizer = param._z3_optimizer
        index, offset, count = optimizer.grad_position[optimizer.get_param_id(param)]
        key = (id(optimizer), int(index))
        if key not in flats:
            flats[key] = _flat_partition(optimizer, param, int(index))
        flat = value.detach().reshape(-1)
        start = count * flats[key][1] if flats[key] is not None else 0
        if flats[key] is None or start + count > flat.numel():
            _set_zero3_master(param, value)
            continue
        destinations.append(flats[key][0].narrow(0, offset, count))
        sources.append(flat.narrow(0, start, count))
        pending += flat.numel() * flat.element_size()
        if pending >= _BATCH_BYTES:
            _copy_batch(destinations, sources)
            pending = 0
    _copy_batch(destinations, sources)


_BATCH_BYTES = 64 * 2**20  # bytes of values one batched copy of masters holds at most


def _copy_batch(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """One batched copy (converting dtype and device as ``copy_`` does); empties both lists."""
    if destinations:
        with torch.no_grad():
            torch._foreach_copy_(destinations, sources)
    destinations.clear()
    sources.clear()


def _flat_partition(optimizer: Any, param: nn.Parameter, index: int) -> tuple[torch.Tensor, int] | None:
    """A sub-group's flat fp32 master partition and this rank's place in the parameters' partition group;
    None where the sub-group may be swapped out (its masters are written one at a time)."""
    if optimizer._swappable_optimizer_subgroup(index):
        return None
    stream = getattr(optimizer, "reduce_and_partition_stream", None)
    if stream is not None:
        stream.synchronize()  # the partitions' last updates are in place
    rank = torch.distributed.get_rank(group=optimizer._get_param_partition_group(param))
    return optimizer.fp32_partitioned_groups_flat[index], rank


def _set_zero3_master(param: nn.Parameter, value: torch.Tensor) -> None:
    """Write this rank's slice of ``value`` into the fp32 master partition, padding included.

    DeepSpeed's ``safe_set_full_fp32_param`` narrows past the end of the value on the rank whose partition
    holds padding (any parameter whose size the world size does not divide), so the slice is cut here.
    """
    optimizer = param._z3_optimizer
    partition, group_index = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False)
    rank = torch.distributed.get_rank(group=optimizer._get_param_partition_group(param))
    flat = value.detach().reshape(-1)
    start = partition.numel() * rank
    count = max(0, min(partition.numel(), flat.numel() - start))
    with torch.no_grad():
        if count:
            partition[:count].copy_(flat[start : start + count].to(partition.device, partition.dtype))
        partition[count:].zero_()
    if optimizer._swappable_optimizer_subgroup(group_index):
        optimizer._optimizer_states_and_gradient_swap_out(group_index)


def load_values_into_engine(module: nn.Module, values: Mapping[str, torch.Tensor], *, set_masters: bool) -> None:
    """Load a full state dict into a live engine's module (its 16-bit partitions, and masters if asked).

    Every rank holds ``values`` whole; ZeRO-3 partitions are rewritten through DeepSpeed's public
    ``GatheredParameters`` (rank 0 writes, DeepSpeed re-partitions). A collective.
    """
    params, buffers = named_tensors(module)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    name_of: dict[int, str] = {}
    for name, param in params.items():
        if name in values:
            name_of.setdefault(id(param), name)
    seen: set[int] = set()
    for sub in module.modules():
        own = [(name_of[id(p)], p) for p in sub.parameters(recurse=False) if id(p) in name_of and id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        with gathered_params([p for _, p in own], modifier_rank=0):
            if rank == 0 or not any(is_zero3_param(p) for _, p in own):
                with torch.no_grad():
                    for n, p in own:
                        p.data.copy_(values[n].reshape(p.data.shape))
    with torch.no_grad():
        for name, buf in buffers.items():
            if name in values:
                buf.copy_(values[name])
    if set_masters:
        set_fp32_masters(module, values)
