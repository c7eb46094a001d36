"""The engine's own checkpoint, kept instead of written: the files DeepSpeed's ``save_checkpoint`` would write for
this rank, every device tensor copied to host memory (so that they outlive the engine; an engine on the CPU
leaves its own), and the device tensors that copy will need, known beforehand so that host memory can be made
ready while the stage runs. Given the parameters' names, a ZeRO-3 optimizer's fp32 master partitions are kept as
recipes (:mod:`.fp32_partitions`), built again from the module's values when a checkpoint is written."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from stagesafe.zero.engine.fp32_partitions import partition_recipes


# Page-locked host memory made ready for a device tensor's copy (shape, dtype), or None where there is none.
HostMemory = Callable[[torch.Size, torch.dtype], "torch.Tensor | None"]


Names = Mapping[int, str]  # id of a parameter -> its state-dict name in the module the boundary gives back


def checkpoint_files(
    engine: Any, *, exclude_frozen: bool, host_memory: HostMemory | None = None, names: Names | None = None
) -> dict[str, dict[str, Any]] | None:
    """The files DeepSpeed's ``save_checkpoint`` would write for this rank now (file name in the tag folder ->
    its state: module placeholders, parameter shapes, step counts, lr scheduler, and the optimizer's partition:
    fp32 masters, moments, loss scaler), every device tensor copied to host memory, so that they outlive the
    engine; an engine on the CPU leaves its own tensors, which nothing writes once it is destroyed.

    DeepSpeed's own code builds them (its checkpoint engine is swapped for one that keeps instead of writing),
    so they are what ``load_checkpoint`` and ``zero_to_fp32`` expect. ``host_memory(shape, dtype)``: page-locked
    memory made ready beforehand for a device tensor's copy, or None (then it is allocated here, which costs
    far more than the copy). ``names``: with them, ZeRO-3's fp32 master partitions are kept as
    :class:`~stagesafe.zero.engine.fp32_partitions.PartitionRecipe` (build them with
    :func:`~stagesafe.zero.engine.fp32_partitions.built_partitions` before writing). Purely local: no
    collective. None where DeepSpeed keeps state outside them (NVMe-swapped optimizer states, MoE layers).
    """
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    own = _on_cpu(engine)
    files = _checkpoint_states(
        engine, exclude_frozen, lambda state: to_host(state, copies, host_memory, keep_host=own), names=names
    )
    _synchronize(copies)
    return files


class LaterCopies:
    """The tensors of :func:`checkpoint_files_later`'s files that still are the engine's own, and where each
    sits in them: :meth:`finish` puts a host copy of each in its place. The engine may be destroyed meanwhile:
    these references keep its tensors, which nothing writes to any more, alive until then."""

    def __init__(self) -> None:
        self.slots: list[tuple[dict | list, Any]] = []  # (container, key): container[key] is an engine tensor

    @property
    def nbytes(self) -> int:
        return sum(container[key].nbytes for container, key in self.slots)

    def finish(self, host_memory: HostMemory | None = None) -> None:
        """Copy every tensor left to host memory (``host_memory(shape, dtype)``: page-locked memory made ready
        for it, or None), in place in the files; the engine's tensors are dropped. Idempotent."""
        slots, self.slots = self.slots, []
        for device in {container[key].device for container, key in slots if container[key].device.type == "cuda"}:
            torch.cuda.set_device(device)  # perhaps in another thread: this rank's GPU, before any copy
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for container, key in slots:
            container[key] = to_host(container[key], copies, host_memory)
        _synchronize(copies)


def checkpoint_files_later(
    engine: Any, *, exclude_frozen: bool, names: Names | None = None
) -> tuple[dict[str, dict[str, Any]] | None, LaterCopies]:
    """:func:`checkpoint_files` without the copies of the tensors on the engine's own device: the files hold
    those tensors themselves until :meth:`LaterCopies.finish` (after the engine is destroyed, off the Trainer
    call's path) copies them. Tensors elsewhere (an offloaded optimizer's, in host memory DeepSpeed may unpin
    as it is destroyed) are copied now. An engine on the CPU leaves nothing for later. Purely local: no
    collective."""
    if _on_cpu(engine):
        return checkpoint_files(engine, exclude_frozen=exclude_frozen, names=names), LaterCopies()
    later, copies = LaterCopies(), []
    on_device = _device_of(engine)
    files = _checkpoint_states(
        engine, exclude_frozen, lambda state: to_host(state, copies, later=later, on_device=on_device), names=names
    )
    _synchronize(copies)
    return files, later


def checkpoint_device_specs(
    engine: Any, *, exclude_frozen: bool, names: Names | None = None
) -> list[tuple[torch.Size, torch.dtype]] | None:
    """Shape and dtype of every device tensor :func:`checkpoint_files` would copy now (with ``names``, without
    the fp32 partitions it keeps as recipes), copying nothing: the host memory to prepare while the stage runs
    (after the first optimizer step: optimizers such as Adam make their state then). None where it would
    return None."""
    specs: list[tuple[torch.Size, torch.dtype]] = []

    def note(state: Any) -> None:
        for tensor in tensors_in(state):
            if tensor.device.type == "cuda":
                specs.append((tensor.shape, tensor.dtype))

    found = _checkpoint_states(engine, exclude_frozen, note, names=names, read_padding=False)
    return specs if found is not None else None


# Optimizers whose state per parameter is known before their first step: tensors of the parameter's shape and dtype.
_STATE_LIKE_PARAMETER = {"Adam": 2, "AdamW": 2, "FusedAdam": 2, "SGD": 0}


def foreseen_state_specs(engine: Any, *, device_type: str = "cuda") -> list[tuple[torch.Size, torch.dtype]]:
    """The tensors the optimizer will make on ``device_type`` at its first step, for optimizers that say so by
    their kind (Adam's two moments, each shaped as its fp32 master): host memory for them can be made ready
    from the engine's start. Empty when the state exists already or the optimizer is another kind."""
    base = getattr(engine.optimizer, "optimizer", None)  # the torch optimizer ZeRO wraps
    per_parameter = _STATE_LIKE_PARAMETER.get(type(base).__name__) if base is not None else None
    if not per_parameter or any(base.state.values()):
        return []
    return [(p.shape, p.dtype) for group in base.param_groups for p in group["params"]
            if p.device.type == device_type for _ in range(per_parameter)]


def _checkpoint_states(
    engine: Any, exclude_frozen: bool, keep: Callable[[dict[str, Any]], Any], *, names: Names | None = None,
    read_padding: bool = True,
) -> dict[str, Any] | None:
    """File name -> ``keep(state)`` for each file DeepSpeed's checkpoint would write for this rank now; the
    engine is left as it was. With ``names``, ZeRO-3's fp32 partitions are recipes instead of tensors."""
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

    writer, engine.checkpoint_engine = engine.checkpoint_engine, _Keep()
    engine.module_state_dict = _with_placeholders(engine)  # shadows the method for this save only
    try:
        engine._save_checkpoint("", "", client_state={}, exclude_frozen_parameters=exclude_frozen)
        if engine.save_zero_checkpoint:
            optimizer_state = engine.optimizer.state_dict()
            recipes = partition_recipes(engine.optimizer, names, read_padding=read_padding) if names else None
            if recipes is not None:
                optimizer_state = {**optimizer_state, _FP32_FLAT_GROUPS: recipes}
            state = {"optimizer_state_dict": optimizer_state, "ds_config": engine.config, "ds_version": version}
            engine.checkpoint_engine.save(state, engine._get_zero_ckpt_name("", ""))
    finally:
        engine.checkpoint_engine = writer
        del engine.module_state_dict
    return files


def _with_placeholders(engine: Any) -> Callable[..., dict[str, Any]]:
    """The engine's ``module_state_dict``, where a ZeRO-3 parameter left gathered (a persistent one, or one
    prefetched for a next forward) is the empty placeholder it is between steps. DeepSpeed's
    ``save_checkpoint`` writes that after partitioning every parameter and gathering the persistent ones again:
    some hundred device operations, which the end of a stage would wait for."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    own = type(engine).module_state_dict.__get__(engine)

    def module_state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
        state = own(*args, **kwargs)
        if state is None:  # an engine that writes its module elsewhere (pipeline parallelism)
            return state
        params = dict(engine.module.named_parameters(remove_duplicate=False))
        for name in list(state):
            param = params.get(name)
            if getattr(param, "ds_status", ZeroParamStatus.NOT_AVAILABLE) != ZeroParamStatus.NOT_AVAILABLE:
                state[name] = torch.empty(0, dtype=param.dtype, device=param.device)
        return state

    return module_state_dict


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``'s dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif type(obj) in (list, tuple):
        for value in obj:
            yield from tensors_in(value)


_FP32_FLAT_GROUPS = "fp32_flat_groups"  # ZeRO-3's key for this rank's fp32 master partitions


def _device_of(engine: Any) -> torch.device | None:
    device = getattr(engine, "device", None)
    return device if isinstance(device, torch.device) else torch.device(device) if device is not None else None


def _on_cpu(engine: Any) -> bool:
    """The engine computes on the CPU: its state is host memory already, and nothing writes it once it is gone."""
    device = _device_of(engine)
    return device is not None and device.type == "cpu"


def _same_device(device: torch.device, on_device: torch.device | None) -> bool:
    if on_device is None or device.type != on_device.type:
        return False
    return device.type != "cuda" or (device.index or 0) == (on_device.index or 0)


def to_host(
    obj: Any,
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    host_memory: HostMemory | None = None,
    *,
    later: LaterCopies | None = None,
    on_device: torch.device | None = None,
    keep_host: bool = False,
) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples replaced by a host copy of its own (a device
    tensor into page-locked memory, asynchronously: synchronize before reading); other values are shared.
    With ``later``, a tensor on ``on_device`` held by a dict or a list stays (its slot noted in ``later``).
    ``keep_host``: a tensor in pageable host memory stays itself (an engine on the CPU: nothing writes it once
    the engine is destroyed, and a copy would hold its bytes twice)."""
    if isinstance(obj, torch.Tensor):
        source = obj.detach()
        if keep_host and source.device.type == "cpu" and not source.is_pinned():
            return source
        if source.device.type != "cuda":
            copy = source.to("cpu", copy=True)
        else:
            copy = host_memory(source.shape, source.dtype) if host_memory is not None else None
            if copy is None:
                copy = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            copy.copy_(source, non_blocking=True)
        copies.append((source, copy))
        return copy
    if isinstance(obj, dict) or type(obj) is list:
        copied = obj.copy()  # keeps the mapping's class (OrderedDict, ...)
        for key, value in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            if later is not None and isinstance(value, torch.Tensor) and _same_device(value.device, on_device):
                copied[key] = value.detach()
                later.slots.append((copied, key))
            else:
                copied[key] = to_host(value, copies, host_memory, later=later, on_device=on_device, keep_host=keep_host)
        return copied
    if type(obj) is tuple:  # immutable: its tensors are copied now, never left for later
        return tuple(to_host(value, copies, host_memory, keep_host=keep_host) for value in obj)
    return obj


def _synchronize(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Wait for the asynchronous device-to-host copies in ``copies``."""
    for device in {source.device for source, _ in copies if source.device.type == "cuda"}:
        torch.cuda.synchronize(device)
