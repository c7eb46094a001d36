"""Everything that touches DeepSpeed internals, and nothing else.

DeepSpeed leaves state on the module it wraps: ``ds_*`` attributes and bound methods on every parameter,
``ds_*``/``_external_params`` attributes and a ``ZeROOrderedDict`` on every submodule, forward hooks, and
empty ``.data`` where a ZeRO-3 partition used to be. This file reads the consolidated weights out of a live
engine, loads exact values into one, and takes a module back to the plain state it had before the engine.
When DeepSpeed changes, this is the one file that changes with it: that is why it is one file of about 700 lines.
It holds four things: the state an engine leaves on a module (footprint, stale state, strip), the weights read
out of a live engine and loaded into one (full specs, gathered values, fp32 masters), a module given its ZeRO-3
partitions, and the engine's own checkpoint files.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

__all__ = [
    "GatheredValues",
    "full_specs",
    "partition_from_values",
    "ModuleFootprint",
    "take_footprint",
    "find_stale_state",
    "is_engine",
    "has_fp32_master",
    "is_zero3_param",
    "full_shape",
    "set_fp32_masters",
    "load_values_into_engine",
    "destroy_engine",
    "strip_deepspeed_state",
    "checkpoint_files",
    "checkpoint_device_specs",
    "foreseen_state_specs",
]

# Page-locked host memory made ready for a device tensor's copy (shape, dtype), or None where there is none.
HostMemory = Callable[[torch.Size, torch.dtype], "torch.Tensor | None"]

# The hook tables an nn.Module keeps; DeepSpeed registers into some of them.
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
# What DeepSpeed's optimizers attach to a parameter besides ``ds_*`` (links to their fp32 partitions).
_PARAM_LINKS = frozenset(
    ("_z3_optimizer", "_hp_mapping", "_dp_group", "get_full_hp_param", "set_full_hp_param", "get_full_hp_grad")
)
# Tensor-level hook tables (gradient hooks DeepSpeed's optimizers register on parameters).
_TENSOR_HOOK_TABLES = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _is_deepspeed_callable(fn: Any) -> bool:
    """True for a hook that DeepSpeed registered (judged by the module its code lives in)."""
    target = getattr(fn, "__func__", fn)
    target = getattr(target, "func", target)  # functools.partial
    module_name = getattr(target, "__module__", "") or ""
    return module_name == "deepspeed" or module_name.startswith("deepspeed.")


@dataclass
class ModuleFootprint:
    """What a module looked like before an engine touched it: attribute names and hook ids, per object."""

    module_attrs: dict[int, set[str]] = field(default_factory=dict)
    module_hooks: dict[int, dict[str, set[int]]] = field(default_factory=dict)
    param_attrs: dict[int, set[str]] = field(default_factory=dict)
    param_hooks: dict[int, dict[str, set[int]]] = field(default_factory=dict)


def _hook_ids(obj: Any, tables: Iterable[str]) -> dict[str, set[int]]:
    ids = {}
    for table in tables:
        hooks = getattr(obj, table, None)
        if isinstance(hooks, Mapping):
            ids[table] = set(hooks.keys())
    return ids


def take_footprint(module: nn.Module, *, fresh: Iterable[int] = ()) -> ModuleFootprint:
    """Record attribute names and hook ids of the module tree, so that what an engine adds can be removed.
    ``fresh`` parameters (built by ``zero.Init`` in this call) count as plain: what DeepSpeed put on them goes."""
    fresh = set(fresh)
    footprint = ModuleFootprint()
    for sub in module.modules():
        footprint.module_attrs[id(sub)] = set(vars(sub))
        footprint.module_hooks[id(sub)] = _hook_ids(sub, _HOOK_TABLES)
    for param in module.parameters():
        plain = id(param) in fresh
        footprint.param_attrs[id(param)] = set() if plain else set(vars(param))
        footprint.param_hooks[id(param)] = {} if plain else _hook_ids(param, _TENSOR_HOOK_TABLES)
    return footprint


def find_stale_state(module: nn.Module, *, fresh: Iterable[int] = ()) -> list[str]:
    """Describe every trace of an earlier DeepSpeed engine on the module; empty when the module is clean.

    ``fresh``: ids of parameters that DeepSpeed's ``zero.Init`` built in the current Trainer call (Lightning's
    ``configure_model``): partitioned by design, not left over."""
    fresh = set(fresh)
    problems: list[str] = []
    for name, sub in module.named_modules():
        label = name or "<root>"
        ds_attrs = sorted(
            k for k in vars(sub) if k.startswith("ds_") or k in ("_external_params", "_original_parameters")
        )
        if ds_attrs:
            problems.append(f"module {label!r} carries DeepSpeed attributes {ds_attrs}")
        if type(sub._parameters).__module__.startswith("deepspeed"):
            problems.append(f"module {label!r} has DeepSpeed's {type(sub._parameters).__name__} as _parameters")
        for table in _HOOK_TABLES:
            hooks = getattr(sub, table, None)
            if isinstance(hooks, Mapping):
                n = sum(1 for hook in hooks.values() if _is_deepspeed_callable(hook))
                if n:
                    problems.append(f"module {label!r} has {n} DeepSpeed hook(s) in {table}")
    for name, param in module.named_parameters(remove_duplicate=True):
        if id(param) in fresh:
            continue
        ds_attrs = sorted(k for k in vars(param) if k.startswith("ds_") or k in _PARAM_LINKS)
        if ds_attrs:
            problems.append(f"parameter {name!r} carries DeepSpeed attributes {ds_attrs[:5]}")
        if param.numel() == 0 and "ds_shape" in vars(param):
            problems.append(f"parameter {name!r} is an empty ZeRO-3 placeholder (shape {tuple(param.shape)})")
    return problems


def is_engine(obj: Any) -> bool:
    """True for a DeepSpeed engine (imports nothing when DeepSpeed was never loaded)."""
    import sys

    engine_module = sys.modules.get("deepspeed.runtime.engine")
    return engine_module is not None and isinstance(obj, engine_module.DeepSpeedEngine)


def is_zero3_param(param: torch.Tensor) -> bool:
    """Partitioned by ZeRO-3 (``zero.Init`` or an engine): its values live in the engine, not in ``.data``."""
    return hasattr(param, "ds_id")


def has_fp32_master(param: torch.Tensor) -> bool:
    """True when the engine's optimizer holds a full-precision master copy of this parameter."""
    if not param.requires_grad:
        return False
    if is_zero3_param(param):
        return getattr(param, "_z3_optimizer", None) is not None
    # ZeRO 1/2 link every parameter of the optimizer's groups, on every rank (``_hp_mapping`` is None where
    # another rank holds the fragment), so this answer is the same everywhere and the gather below matches.
    return "get_full_hp_param" in vars(param)


@contextlib.contextmanager
def _gathered(params: list[nn.Parameter], modifier_rank: int | None = None) -> Iterator[None]:
    """Make ZeRO-3 parameters whole for the duration of the block (a collective: every rank enters)."""
    partitioned = [p for p in params if is_zero3_param(p)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def _named_tensors(module: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    """Parameters and persistent buffers by their state-dict name (tied parameters appear once per name)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    state_keys = set(module.state_dict(keep_vars=True).keys())
    buffers = {n: b for n, b in module.named_buffers(remove_duplicate=False) if n in state_keys}
    return params, buffers


def full_specs(module: nn.Module) -> tuple[dict[str, tuple[torch.Size, torch.dtype]], dict[str, str]]:
    """Full shape and dtype of every state-dict tensor of a live engine's module, and the tied-name aliases."""
    params, buffers = _named_tensors(module)
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
        also_into: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """``into``: fp32 host tensors that a master is copied into (and returned) instead of fresh memory;
        ``also_into``: host tensors for a second copy (a background writer's private one), filled later by
        :meth:`fill_copies`, off the caller's path; the gathered masters are kept until then."""
        self._params, self._buffers = _named_tensors(module)
        self._to_dtype = to_dtype
        self._into, self._also_into = dict(into or {}), dict(also_into or {})
        self._devices: set[torch.device] = set()
        self.copied: dict[str, torch.Tensor] = {}  # the ``also_into`` tensors, once fill_copies() has run
        self._kept: dict[str, torch.Tensor] = {}  # gathered masters waiting to be copied into ``also_into``
        self._ready: dict[str, tuple[torch.Tensor, bool]] = {}  # gathered masters, by name: (tensor, in `into`)

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
        with _quiet_collectives(), _gathered([param]):
            return self._to_dtype(name, param.data.detach().to("cpu", copy=True))

    def _place(self, name: str, master: torch.Tensor, stream: Any) -> torch.Tensor | None:
        """Copy a gathered master into its host tensor (on ``stream``, asynchronously), and keep it for the
        writer's private copy; None when it has no host tensor to go to."""
        dest = self._into.get(name)
        if dest is None or not _fits(dest, master):
            return None
        self._devices.add(master.device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dest.view(-1).copy_(master.view(-1), non_blocking=True)
        if stream is not None:
            master.record_stream(stream)
        copy = self._also_into.get(name)
        if copy is not None and _fits(copy, master):
            self.copied[name] = copy
            self._kept[name] = master  # a buffer of its own: nothing else writes to it
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
        gathered = torch.empty(world * bucket.length, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(gathered, local, group=bucket.group)
        rows = gathered.view(world, bucket.length)
        for name, param, offset, count in bucket.members:
            pieces = rows[:, offset - bucket.start : offset - bucket.start + count].reshape(-1)
            master = pieces[: param.ds_numel].reshape(param.ds_shape)
            if world == 1:  # a view of the bucket, which goes: a tensor of its own
                master = master.clone()
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(master.device))
            placed = self._place(name, master, stream)
            self._ready[name] = (master, False) if placed is None else (placed, True)

    def synchronize(self) -> None:
        """Wait for the copies into ``into`` (asynchronous into page-locked memory) and the gathers."""
        for device in self._devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def fill_copies(self) -> None:
        """Copy the kept masters into their ``also_into`` tensors and let the masters go: in a background writer,
        after :meth:`synchronize`. On a GPU the copies run on a stream of their own, so that they neither wait
        for nor hold up the next stage's work on the default stream."""
        kept, self._kept = self._kept, {}
        streams = {
            device: torch.cuda.Stream(device)
            for device in {m.device for m in kept.values()}
            if device.type == "cuda"
        }
        for name, master in kept.items():
            stream = streams.get(master.device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.copied[name].view(-1).copy_(master.view(-1), non_blocking=stream is not None)
        for stream in streams.values():
            stream.synchronize()

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
    return (
        dest.device.type == "cpu"
        and dest.dtype == master.dtype
        and dest.numel() == master.numel()
        and dest.is_contiguous()
    )


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


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of a parameter's values, also for a ZeRO-3 placeholder whose ``.data`` is empty."""
    return getattr(param, "ds_shape", param.shape)


def set_fp32_masters(module: nn.Module, values: Mapping[str, torch.Tensor]) -> int:
    """Make the optimizer's fp32 master weights equal ``values`` bit for bit; returns how many were set.

    DeepSpeed builds its masters from the module after casting it to 16 bits, which rounds them; this puts
    the exact values back. Purely local: each rank writes its own partition.
    """
    import deepspeed.utils

    count = 0
    seen: set[int] = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen or not has_fp32_master(param) or name not in values:
            continue
        seen.add(id(param))
        if is_zero3_param(param):
            _set_zero3_master(param, values[name])
        else:
            value = values[name].detach().to(device=param.device, dtype=torch.float32)
            deepspeed.utils.safe_set_full_fp32_param(param, value)
        count += 1
    return count


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
    params, buffers = _named_tensors(module)
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
        with _gathered([p for _, p in own], modifier_rank=0):
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


def checkpoint_files(
    engine: Any, *, exclude_frozen: bool, host_memory: HostMemory | None = None
) -> dict[str, dict[str, Any]] | None:
    """The files DeepSpeed's ``save_checkpoint`` would write for this rank now (file name in the tag folder ->
    its state: module placeholders, parameter shapes, step counts, lr scheduler, and the optimizer's partition:
    fp32 masters, moments, loss scaler), every tensor copied to host memory, so that they outlive the engine.

    DeepSpeed's own code builds them (its checkpoint engine is swapped for one that keeps instead of writing),
    so they are what ``load_checkpoint`` and ``zero_to_fp32`` expect. ``host_memory(shape, dtype)``: page-locked
    memory made ready beforehand for a device tensor's copy, or None (then it is allocated here, which costs
    far more than the copy). Purely local: no collective. None where DeepSpeed keeps state outside them
    (NVMe-swapped optimizer states, MoE layers).
    """
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    files = _checkpoint_states(engine, exclude_frozen, lambda state: _to_host(state, copies, host_memory))
    for device in {source.device for source, _ in copies if source.device.type == "cuda"}:
        torch.cuda.synchronize(device)
    return files


def checkpoint_device_specs(engine: Any, *, exclude_frozen: bool) -> list[tuple[torch.Size, torch.dtype]] | None:
    """Shape and dtype of every device tensor :func:`checkpoint_files` would copy now, copying nothing: the
    host memory to prepare while the stage runs (after the first optimizer step: optimizers such as Adam make
    their state then). None where it would return None."""
    specs: list[tuple[torch.Size, torch.dtype]] = []

    def note(state: Any) -> None:
        for tensor in _tensors_in(state):
            if tensor.device.type == "cuda":
                specs.append((tensor.shape, tensor.dtype))

    return specs if _checkpoint_states(engine, exclude_frozen, note, settle=False) is not None else None


# Optimizers whose state per parameter is known before their first step: tensors of the parameter's shape and dtype.
_STATE_LIKE_PARAMETER = {"Adam": 2, "AdamW": 2, "FusedAdam": 2, "SGD": 0}


def foreseen_state_specs(engine: Any) -> list[tuple[torch.Size, torch.dtype]]:
    """The device tensors the optimizer will make at its first step, for optimizers that say so by their kind
    (Adam's two moments, each shaped as its fp32 master): host memory for them can be made ready from the
    engine's start. Empty when the state exists already or the optimizer is another kind."""
    base = getattr(engine.optimizer, "optimizer", None)  # the torch optimizer ZeRO wraps
    per_parameter = _STATE_LIKE_PARAMETER.get(type(base).__name__) if base is not None else None
    if not per_parameter or any(base.state.values()):
        return []
    return [(p.shape, p.dtype) for group in base.param_groups for p in group["params"]
            if p.device.type == "cuda" for _ in range(per_parameter)]


def _checkpoint_states(
    engine: Any, exclude_frozen: bool, keep: Callable[[dict[str, Any]], Any], *, settle: bool = True
) -> dict[str, Any] | None:
    """File name -> ``keep(state)`` for each file DeepSpeed's checkpoint would write for this rank now.
    ``settle``: first release the ZeRO-3 parameters a step left gathered (not while training goes on)."""
    if engine.optimizer is None or engine.has_moe_layers or engine.zero_nvme_offload_optimizer():
        return None
    import os

    from deepspeed.git_version_info import version

    files: dict[str, Any] = {}

    class _Keep:
        def save(self, state_dict: dict, path: str) -> None:
            files[os.path.basename(path)] = keep(state_dict)

        def makedirs(self, *args: Any, **kwargs: Any) -> None:
            pass

    if settle and hasattr(engine.optimizer, "empty_partition_cache"):
        # ZeRO-3 parameters the last step left gathered (prefetched for a next forward) are written as the
        # placeholders they are between steps, as a save during the stage writes them, not as full tensors
        engine.optimizer.empty_partition_cache()
    writer, engine.checkpoint_engine = engine.checkpoint_engine, _Keep()
    try:
        engine._save_checkpoint("", "", client_state={}, exclude_frozen_parameters=exclude_frozen)
        if engine.save_zero_checkpoint:
            state = {"optimizer_state_dict": engine.optimizer.state_dict(), "ds_config": engine.config,
                     "ds_version": version}
            engine.checkpoint_engine.save(state, engine._get_zero_ckpt_name("", ""))
    finally:
        engine.checkpoint_engine = writer
    return files


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``'s dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif type(obj) in (list, tuple):
        for value in obj:
            yield from _tensors_in(value)


def _to_host(
    obj: Any, copies: list[tuple[torch.Tensor, torch.Tensor]], host_memory: HostMemory | None = None
) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples replaced by a host copy of its own (a device
    tensor into page-locked memory, asynchronously: synchronize before reading); other values are shared."""
    if isinstance(obj, torch.Tensor):
        source = obj.detach()
        if source.device.type != "cuda":
            copy = source.to("cpu", copy=True)
        else:
            copy = host_memory(source.shape, source.dtype) if host_memory is not None else None
            if copy is None:
                copy = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            copy.copy_(source, non_blocking=True)
        copies.append((source, copy))
        return copy
    if isinstance(obj, dict):
        copied = obj.copy()  # keeps the mapping's class (OrderedDict, ...)
        for key, value in obj.items():
            copied[key] = _to_host(value, copies, host_memory)
        return copied
    if type(obj) in (list, tuple):
        return type(obj)(_to_host(value, copies, host_memory) for value in obj)
    return obj


def destroy_engine(engine: Any) -> None:
    """Let DeepSpeed remove what it registered (module and gradient hooks, by handle)."""
    engine.destroy()


def strip_deepspeed_state(module: nn.Module, footprint: ModuleFootprint | None) -> None:
    """Take the module back to plain PyTorch: drop every attribute, hook and container DeepSpeed added.

    Attributes and hooks present in ``footprint`` (taken before the engine) are the user's and are kept;
    without a footprint only what is recognisably DeepSpeed's goes. Tensor values are not touched here.
    """
    params, _ = _named_tensors(module)
    for sub in module.modules():
        _restore_parameter_dict(sub)
        before = footprint.module_attrs.get(id(sub)) if footprint else None
        for key in list(vars(sub)):
            added = before is not None and key not in before
            if added or key.startswith("ds_") or key in ("_external_params", "_original_parameters"):
                if key.startswith("_") and key in _MODULE_SLOTS:
                    continue
                delattr(sub, key)
        _remove_hooks(sub, _HOOK_TABLES, footprint.module_hooks.get(id(sub)) if footprint else None)
    done: set[int] = set()
    for param in params.values():
        if id(param) in done:
            continue
        done.add(id(param))
        before = footprint.param_attrs.get(id(param)) if footprint else None
        for key in list(vars(param)):
            if (before is not None and key not in before) or key.startswith("ds_") or key in _PARAM_LINKS:
                delattr(param, key)
        _remove_hooks(param, _TENSOR_HOOK_TABLES, footprint.param_hooks.get(id(param)) if footprint else None)


# nn.Module's own bookkeeping attributes, never to be deleted even when a footprint is missing.
_MODULE_SLOTS = frozenset(vars(nn.Module()).keys())


def _restore_parameter_dict(sub: nn.Module) -> None:
    """Replace DeepSpeed's ZeROOrderedDict by a plain dict holding the same parameters, in order."""
    params = sub.__dict__.get("_parameters")
    if params is not None and type(params) is not dict and type(params).__module__.startswith("deepspeed"):
        sub.__dict__["_parameters"] = {k: dict.__getitem__(params, k) for k in dict.keys(params)}


def _remove_hooks(obj: Any, tables: Iterable[str], keep: dict[str, set[int]] | None) -> None:
    """Remove hooks registered after the footprint; without one, remove only DeepSpeed's."""
    for table in tables:
        hooks = getattr(obj, table, None)
        if not isinstance(hooks, dict) or not hooks:
            continue
        kept_ids = keep.get(table, set()) if keep is not None else None
        for hook_id in list(hooks.keys()):
            if kept_ids is not None and hook_id not in kept_ids:
                del hooks[hook_id]
            elif kept_ids is None and _is_deepspeed_callable(hooks[hook_id]):
                del hooks[hook_id]
