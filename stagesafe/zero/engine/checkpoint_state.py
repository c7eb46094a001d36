"""The engine's own checkpoint, kept instead of written: the files DeepSpeed's ``save_checkpoint`` would write for
this rank, every tensor copied to host memory (so that they outlive the engine), and the device tensors that copy
will need, known beforehand so that host memory can be made ready while the stage runs."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch


# Page-locked host memory made ready for a device tensor's copy (shape, dtype), or None where there is none.
HostMemory = Callable[[torch.Size, torch.dtype], "torch.Tensor | None"]


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
            container[key] = _to_host(container[key], copies, host_memory)
        _synchronize(copies)


def checkpoint_files_later(engine: Any, *, exclude_frozen: bool) -> tuple[dict[str, dict[str, Any]] | None, LaterCopies]:
    """:func:`checkpoint_files` without the copies of the tensors on the engine's own device: the files hold
    those tensors themselves until :meth:`LaterCopies.finish` (after the engine is destroyed, off the Trainer
    call's path) copies them. Tensors elsewhere (an offloaded optimizer's, in host memory DeepSpeed may unpin
    as it is destroyed) are copied now. Purely local: no collective."""
    later, copies = LaterCopies(), []
    device = getattr(engine, "device", None)
    on_device = device if isinstance(device, torch.device) else torch.device(device) if device is not None else None
    files = _checkpoint_states(
        engine, exclude_frozen, lambda state: _to_host(state, copies, later=later, on_device=on_device)
    )
    _synchronize(copies)
    return files, later


def checkpoint_device_specs(engine: Any, *, exclude_frozen: bool) -> list[tuple[torch.Size, torch.dtype]] | None:
    """Shape and dtype of every device tensor :func:`checkpoint_files` would copy now, copying nothing: the
    host memory to prepare while the stage runs (after the first optimizer step: optimizers such as Adam make
    their state then). None where it would return None."""
    specs: list[tuple[torch.Size, torch.dtype]] = []

    def note(state: Any) -> None:
        for tensor in _tensors_in(state):
            if tensor.device.type == "cuda":
                specs.append((tensor.shape, tensor.dtype))

    return specs if _checkpoint_states(engine, exclude_frozen, note) is not None else None


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
    engine: Any, exclude_frozen: bool, keep: Callable[[dict[str, Any]], Any]
) -> dict[str, Any] | None:
    """File name -> ``keep(state)`` for each file DeepSpeed's checkpoint would write for this rank now; the
    engine is left as it was."""
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
            state = {"optimizer_state_dict": engine.optimizer.state_dict(), "ds_config": engine.config,
                     "ds_version": version}
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


def _same_device(device: torch.device, on_device: torch.device | None) -> bool:
    if on_device is None or device.type != on_device.type:
        return False
    return device.type != "cuda" or (device.index or 0) == (on_device.index or 0)


def _to_host(
    obj: Any,
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    host_memory: HostMemory | None = None,
    *,
    later: LaterCopies | None = None,
    on_device: torch.device | None = None,
) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples replaced by a host copy of its own (a device
    tensor into page-locked memory, asynchronously: synchronize before reading); other values are shared.
    With ``later``, a tensor on ``on_device`` held by a dict or a list stays (its slot noted in ``later``)."""
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
    if isinstance(obj, dict) or type(obj) is list:
        copied = obj.copy()  # keeps the mapping's class (OrderedDict, ...)
        for key, value in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            if later is not None and isinstance(value, torch.Tensor) and _same_device(value.device, on_device):
                copied[key] = value.detach()
                later.slots.append((copied, key))
            else:
                copied[key] = _to_host(value, copies, host_memory, later=later, on_device=on_device)
        return copied
    if type(obj) is tuple:  # immutable: its tensors are copied now, never left for later
        return tuple(_to_host(value, copies, host_memory) for value in obj)
    return obj


def _synchronize(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Wait for the asynchronous device-to-host copies in ``copies``."""
    for device in {source.device for source, _ in copies if source.device.type == "cuda"}:
        torch.cuda.synchronize(device)
