"""A ZeRO checkpoint put into a live engine, written by any number of ranks, read without running its pickles.

:func:`rank_files` builds this rank's files of the checkpoint in the form DeepSpeed's ``save_checkpoint`` writes
them for this engine (the form :func:`~stagesafe.zero.engine.checkpoint_state.checkpoint_files` keeps them in at
a stage's end: file name -> state): its model states (the counters, the module's buffers and placeholders, this
rank's fragments of the frozen parameters) and its optimizer partition (the fp32 masters, every per-element state
of the optimizer such as Adam's moments, the step counts, the param groups' hyperparameters, the loss scaler),
each flat partition filled parameter by parameter from the checkpoint's state
(:class:`~stagesafe.zero.checkpoint_optimizer.CheckpointOptimizer`), whatever number of ranks wrote it. The
checkpoint's slices are read into the engine's own tensors (its fp32 masters; the optimizer's per-element state
where it holds it, else new tensors on the engine's device): in host memory straight into them, on a device
through a bounded host staging buffer (:func:`~stagesafe.zero.staged_reads.read_staged`), so no rank holds its
partition twice or in host memory. :func:`load_rank_files` then loads the files with DeepSpeed's own methods (the
partitions copied onto themselves), in the order its ``load_checkpoint`` does after reading its files with
``torch.load`` (which runs code a file names).

What cannot be put into this engine is refused before anything is read into it, naming what differs: another ZeRO
stage, parameters the checkpoint lacks or holds beyond the model's, other shapes, other param groups, another
optimizer class (other hyperparameters), optimizer state that is not per parameter. (A rank file that shrinks
while it is read fails the call, the engine's partitions partly read.)
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stagesafe.errors import CheckpointFormatError, InvalidArgumentError, StateDictMismatchError, shown
from stagesafe.zero.checkpoint import open_zero_checkpoint
from stagesafe.handoff.optimizer_state import open_form
from stagesafe.zero.checkpoint_optimizer import CheckpointOptimizer
from stagesafe.zero.handoff_optimizer import HandoffOptimizer
from stagesafe.zero.staged_reads import read_staged
from stagesafe.zero.pickle_globals import OpaqueRecord

__all__ = [
    "FlatPartition",
    "load_optimizer_state",
    "load_rank_files",
    "partition_layout",
    "rank_files",
    "read_handoff_optimizer",
    "state_numbers",
    "read_rank_files",
]

log = logging.getLogger(__name__)

# Hyperparameters a scheduler adds to a param group: not the optimizer's own.
_SCHEDULER_KEYS = {"params", "initial_lr"}


@dataclass(frozen=True)
class FlatPartition:
    """One flat partition of this rank's optimizer: ``numel`` elements (padding included) of param group
    ``group``, of which DeepSpeed saves the first ``saved`` as the fp32 master partition; ``slices`` are (name,
    offset in the flat, first element of the flattened full value, elements)."""

    group: int
    numel: int
    saved: int
    slices: tuple[tuple[str, int, int, int], ...]


def _names(engine: Any) -> dict[int, str]:
    """id of a parameter -> the name DeepSpeed saves it under (the first of tied names)."""
    return {id(p): n for p, n in engine.param_names.items()}


def _zero3(engine: Any) -> bool:
    return bool(engine.zero_optimization_partition_weights())


def _bf16(engine: Any) -> bool:
    """ZeRO-1 under bf16 with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer, not its ZeRO optimizer."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return isinstance(engine.optimizer, BF16_Optimizer)


def partition_layout(engine: Any) -> list[FlatPartition]:
    """Where each trained parameter's elements lie in this rank's flat partitions (ZeRO 1/2: a param group's
    rank partition of its flat buffer; ZeRO-3: a sub-group's partitions of its parameters, in order)."""
    import torch.distributed as dist

    optimizer, names = engine.optimizer, _names(engine)
    out = []
    if _zero3(engine):
        for index, (flat, params) in enumerate(zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_groups)):
            slices = []
            for param in params:
                _, offset, count = (int(x) for x in optimizer.grad_position[optimizer.get_param_id(param)])
                first = dist.get_rank(group=optimizer._get_param_partition_group(param)) * count
                real = max(0, min(count, int(param.ds_numel) - first))
                if real:
                    slices.append((names[id(param)], offset, first, real))
            group = int(optimizer.sub_group_to_group_id[index])
            out.append(FlatPartition(group, flat.numel(), flat.numel(), tuple(slices)))
        return out
    if _bf16(engine):  # each param group's parameters back to back, the flat buffer padded at its end
        for index, params in enumerate(optimizer.bf16_groups):
            group = optimizer.real_dp_process_group[index]
            size = optimizer.bf16_groups_flat[index].numel() // dist.get_world_size(group=group)
            low = dist.get_rank(group=group) * size
            slices, offset = [], 0
            for param in params:
                start, end = max(low, offset), min(low + size, offset + param.numel())
                if start < end:
                    slices.append((names[id(param)], start - low, start - offset, end - start))
                offset += param.numel()
            out.append(FlatPartition(index, size, size, tuple(slices)))
        return out
    for index, params in enumerate(optimizer.round_robin_bit16_groups):
        size = int(optimizer.partition_size[index])
        low = dist.get_rank(group=optimizer.real_dp_process_group[index]) * size
        slices = []
        for param, offset, meta in zip(params, optimizer.round_robin_bit16_offsets[index],
                                       optimizer.round_robin_bit16_meta[index]):
            start, end = max(low, offset), min(low + size, offset + meta.numel())
            if start < end:
                slices.append((names[id(param)], start - low, start - offset, end - start))
        out.append(FlatPartition(index, size, size - int(optimizer.groups_padding[index]), tuple(slices)))
    return out


def state_numbers(layout: list[FlatPartition]) -> list[int]:
    """The torch optimizer numbers the flat partitions param group by param group (ZeRO-3 appends each sub-group
    to its group's params): the k-th of its state dict is the partition ``state_numbers(layout)[k]``."""
    return sorted(range(len(layout)), key=lambda index: (layout[index].group, index))


def read_rank_files(engine: Any, path: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """This rank's files of the checkpoint folder ``path`` (any number of ranks wrote it) for ``engine``, and the
    client state of its model states (Lightning's entries), all read by stagesafe's reader: see the module."""
    with open_zero_checkpoint(path) as ckpt:
        source = CheckpointOptimizer(ckpt)
        files = rank_files(engine, source)
        model_name = _model_name(engine)
        client = ckpt.client_state
        files[model_name] = {**client, **files[model_name]}
        return files, client


def rank_files(engine: Any, source: CheckpointOptimizer) -> dict[str, dict[str, Any]]:
    """This rank's checkpoint files for ``engine``, built from ``source`` (see the module): {file name: state}."""
    _check_engine(engine, source)
    layout = partition_layout(engine)
    _check_parameters(engine, source)
    model_states = {**source.model_states(), "frozen_param_fragments": _frozen(engine, source)}
    optimizer_state = _optimizer_state(engine, source, layout)  # last: it reads into the engine's own partitions
    from deepspeed.git_version_info import version

    optim = {"optimizer_state_dict": optimizer_state, "ds_config": engine.config, "ds_version": version}
    return {_model_name(engine): model_states, os.path.basename(engine._get_zero_ckpt_name("", "")): optim}


def load_rank_files(engine: Any, files: Mapping[str, Mapping[str, Any]], *, strict: bool = True) -> None:
    """Load this rank's checkpoint ``files`` (:func:`rank_files`' form) into the live ``engine`` with DeepSpeed's
    own methods, as ``engine.load_checkpoint`` does once it has read its files: the module (buffers, frozen
    fragments), the engine's counters, the optimizer partition (masters, state, loss scaler; the 16-bit
    partitions from the masters). A collective under ZeRO-3 (its parameters are partitioned first and the
    persistent ones gathered after)."""
    model = files[_model_name(engine)]
    optimizer_state = files[os.path.basename(engine._get_zero_ckpt_name("", ""))]["optimizer_state_dict"]
    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    engine.load_module_state_dict(checkpoint=dict(model), strict=strict)
    engine.loaded_checkpoint_dp_world_size = model.get("dp_world_size")
    engine.loaded_checkpoint_mp_world_size = model.get("mp_world_size", 1)
    engine.global_steps = model.get("global_steps", 0)
    engine.global_samples = model.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = model.get("skipped_steps", 0)
    _load_optimizer(engine, optimizer_state)
    if engine._optimizer_has_ckpt_event_epilogue():
        engine.optimizer.checkpoint_event_epilogue()


def read_handoff_optimizer(
    engine: Any, uri: str, *, storage_options: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """This rank's optimizer state dict for ``engine`` (as its ``optimizer.state_dict()`` would give it) from the
    optimizer state beside the handoff at ``uri`` (:mod:`stagesafe.handoff.optimizer_state`), written from any
    number of ranks; None when the handoff holds weights only. The fp32 masters are the handoff's weights, the
    moments and step counts the state's; the optimizer's hyperparameters stay this engine's. Refused, naming what
    differs, as :func:`rank_files` refuses a checkpoint: a parameter missing, another model, another optimizer."""
    form = open_form(uri, storage_options=storage_options)
    if form is None:
        return None
    source = HandoffOptimizer(form, uri, storage_options=storage_options)
    _check_engine(engine, source)
    layout = partition_layout(engine)
    _check_parameters(engine, source)
    return _optimizer_state(engine, source, layout)


def load_optimizer_state(engine: Any, optimizer_state: Mapping[str, Any]) -> None:
    """Load :func:`read_handoff_optimizer`'s state dict into ``engine``'s optimizer with DeepSpeed's own method
    (a collective under ZeRO-3); the 16-bit parameters are made again from the masters."""
    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    _load_optimizer(engine, optimizer_state)
    if engine._optimizer_has_ckpt_event_epilogue():
        engine.optimizer.checkpoint_event_epilogue()


def _load_optimizer(engine: Any, optimizer_state: Mapping[str, Any]) -> None:
    import torch.distributed as dist

    group = engine.optimizer.dp_process_group
    state_dict_list: list[Any] = [None] * dist.get_world_size(group=group)
    state_dict_list[dist.get_rank(group=group)] = optimizer_state
    engine.optimizer.load_state_dict(
        state_dict_list=state_dict_list,
        load_optimizer_states=True,
        load_from_fp32_weights=engine.zero_load_from_fp32_weights(),
        checkpoint_folder=None,
        param_shapes=engine._get_zero_param_shapes(),
    )


# -- checks ----------------------------------------------------------------------------------------------------------


def _check_engine(engine: Any, source: CheckpointOptimizer | HandoffOptimizer) -> None:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if not isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer)):
        raise InvalidArgumentError(
            f"this engine's optimizer is DeepSpeed's {type(optimizer).__name__}, whose checkpoint stagesafe does not "
            "load (it loads those of the ZeRO 1/2 and ZeRO-3 optimizers, and of BF16_Optimizer: ZeRO-1 with bf16)"
        )
    if engine.zero_nvme_offload_optimizer() or engine.has_moe_layers:
        raise InvalidArgumentError(
            "this engine swaps its optimizer state to NVMe or has MoE layers; stagesafe does not load checkpoints "
            "into such an engine"
        )
    stage = 3 if _zero3(engine) else int(engine.zero_optimization_stage())
    if source.stage is not None and (stage == 3) != (source.stage == 3):
        raise CheckpointFormatError(
            f"{source.tag_url!r} was written under ZeRO stage {source.stage} and this engine runs stage {stage}: "
            "their partitions differ in kind. Resume with the stage that wrote it, or consolidate it "
            "(stagesafe consolidate) and resume_from= the weights"
        )


def _check_parameters(engine: Any, source: CheckpointOptimizer | HandoffOptimizer) -> None:
    """The checkpoint's trained parameters are this engine's, with their shapes and param groups."""
    specs = source.specs
    trained = {n: s for n, s in specs.items() if s.kind == "param"}
    ours = {name: (shape, group) for name, shape, group in _trained_parameters(engine)}  # full shape, param group
    groups = engine.optimizer.optimizer.param_groups
    missing, extra = sorted(set(ours) - set(trained)), sorted(set(trained) - set(ours))
    if missing or extra:
        frozen = [n for n in missing if n in specs]
        raise StateDictMismatchError(
            f"{source.tag_url!r} does not hold this model's trained parameters: "
            + "; ".join(
                part for part in (
                    f"missing {_few(missing)}" if missing else "",
                    f"of which frozen in the checkpoint: {_few(frozen)}" if frozen else "",
                    f"held but not trained by this model: {_few(extra)}" if extra else "",
                ) if part
            )
            + ". A checkpoint resumes the model that wrote it; for its weights alone, consolidate it (stagesafe "
            "consolidate) and load what fits"
        )
    shapes = [f"{n} {list(trained[n].shape)} in the checkpoint, {list(s)} here" for n, (s, _) in ours.items()
              if tuple(trained[n].shape) != tuple(s)]
    if shapes:
        raise StateDictMismatchError(f"{source.tag_url!r} holds other shapes than this model: {_few(shapes)}")
    if source.param_groups is not None and len(source.param_groups) != len(groups):
        raise CheckpointFormatError(
            f"{source.tag_url!r} holds {len(source.param_groups)} optimizer param group(s), this optimizer has "
            f"{len(groups)}"
        )
    moved = [f"{n} (group {source.param_group_of(n)} there, {g} here)" for n, (_, g) in ours.items()
             if source.param_group_of(n) != g]
    if moved:
        raise CheckpointFormatError(f"{source.tag_url!r} puts parameters in other param groups: {_few(moved)}")
    if source.param_groups is not None:
        for index, (saved, live) in enumerate(zip(source.param_groups, groups)):
            there = sorted(set(saved) - set(live) - _SCHEDULER_KEYS)
            here = sorted(set(live) - set(saved) - _SCHEDULER_KEYS)
            if there or here:
                raise CheckpointFormatError(
                    f"{source.tag_url!r} was written by another optimizer than this "
                    f"{type(engine.optimizer.optimizer).__name__}: its param group {index} has the hyperparameters "
                    f"{there} and lacks {here}; its state would not be this optimizer's. Resume with the "
                    "optimizer that wrote it"
                )


def _trained_parameters(engine: Any) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, full shape, param group) of every parameter this engine's optimizer trains."""
    optimizer, names = engine.optimizer, _names(engine)
    out = []
    if _zero3(engine):
        for index, params in enumerate(optimizer.fp16_groups):
            group = int(optimizer.sub_group_to_group_id[index])
            out.extend((names[id(p)], tuple(p.ds_shape), group) for p in params)
    else:
        for index, params in enumerate(optimizer.bf16_groups if _bf16(engine) else optimizer.bit16_groups):
            out.extend((names[id(p)], tuple(p.shape), index) for p in params)
    return out


def _few(items: list[str]) -> str:
    return ", ".join(shown(i, 120) for i in items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")


# -- building ---------------------------------------------------------------------------------------------------------


def _optimizer_state(
    engine: Any, source: CheckpointOptimizer | HandoffOptimizer, layout: list[FlatPartition]
) -> dict[str, Any]:
    """This rank's ZeRO optimizer state dict, as the engine's ``optimizer.state_dict()`` would give it."""
    optimizer = engine.optimizer
    reads: list[tuple[str, str | None, int, torch.Tensor]] = []  # (name, key, first element, where it goes)
    engine_masters = (optimizer.fp32_partitioned_groups_flat if _zero3(engine)
                      else optimizer.fp32_groups_flat_partition if _bf16(engine)
                      else optimizer.single_partition_of_fp32_groups)
    masters = []
    for index, part in enumerate(layout):
        master = _flat(source, part, None, into=_engine_flat(engine_masters[index], part.numel), reads=reads,
                       device=engine_masters[index].device, keep_gaps=True)
        masters.append(master if part.saved == part.numel else master[: part.saved])
    base_state: dict[int, dict[str, Any]] = {}
    for number, index in enumerate(state_numbers(layout)):
        part = layout[index]
        state = dict(source.values(source.partition_of_group(part.group)))
        held = _engine_state(optimizer, engine_masters[index])
        for key in source.element_keys:
            state[key] = _flat(source, part, key, reads=reads, into=_engine_flat(held.get(key), part.numel),
                               device=engine_masters[index].device)
        if state:
            base_state[number] = state
    read_staged(source.read_all, reads)
    groups = _param_groups(engine, source)
    global_state = dict(source.global_state)
    if _bf16(engine):  # BF16_Optimizer's own state_dict: no loss scaler, its fp32 partitions whole
        return {
            "clip_grad": global_state.get("clip_grad", optimizer.clip_grad),
            "base_optimizer_state": {"state": base_state, "param_groups": groups},
            "single_partition_of_fp32_groups": masters,
            "group_paddings": list(optimizer.group_paddings),
            "partition_count": optimizer.partition_count,
            "ds_version": global_state.get("ds_version") or _version(),
            "param_slice_mappings": getattr(optimizer, "_param_slice_mappings", None),
        }
    global_state["loss_scaler"] = _loss_scaler(optimizer.loss_scaler, global_state.get("loss_scaler"))
    if _zero3(engine):
        return {
            "zero_stage": 3,
            "loss_scaler": global_state["loss_scaler"],
            "dynamic_loss_scale": global_state.get("dynamic_loss_scale", optimizer.dynamic_loss_scale),
            "overflow": global_state.get("overflow", optimizer.overflow),
            "partition_count": optimizer.partition_count,
            "optimizer_state_dict": {"state": base_state, "param_groups": groups},
            "fp32_flat_groups": masters,
        }
    return {
        "loss_scaler": global_state["loss_scaler"],
        "dynamic_loss_scale": global_state.get("dynamic_loss_scale", optimizer.dynamic_loss_scale),
        "overflow": global_state.get("overflow", optimizer.overflow),
        "clip_grad": global_state.get("clip_grad", optimizer.clip_grad),
        "base_optimizer_state": {"state": base_state, "param_groups": groups},
        "single_partition_of_fp32_groups": masters,
        "zero_stage": 2 if optimizer.partition_gradients else 1,
        "group_paddings": list(optimizer.groups_padding),
        "param_alignment_paddings": optimizer.round_robin_bit16_padding,
        "partition_count": optimizer.partition_count,
        "ds_version": global_state.get("ds_version") or _version(),
        "param_slice_mappings": getattr(optimizer, "_param_slice_mappings", None),
    }


def _flat(
    source: CheckpointOptimizer | HandoffOptimizer, part: FlatPartition, key: str | None, *, reads: list,
    into: torch.Tensor | None, device: torch.device, keep_gaps: bool = False,
) -> torch.Tensor:
    """A flat partition of ``key`` (None: the fp32 masters), each parameter's slice to be read from the checkpoint
    (added to ``reads``): into ``into`` (the engine's own partition or optimizer state, on its device: no second
    copy of it; what lies between the slices zeroed, or with ``keep_gaps`` left as it is), else into new memory
    on ``device``, zeros where DeepSpeed pads."""
    dtype = getattr(torch, source.element_dtypes[key] if key is not None else source.master_dtype)
    flat = into if into is not None and into.dtype == dtype else torch.empty(part.numel, dtype=dtype, device=device)
    zero_gaps = flat is not into or not keep_gaps
    at = 0
    for name, offset, first, count in sorted(part.slices, key=lambda s: s[1]):
        if zero_gaps and offset > at:
            flat.narrow(0, at, offset - at).zero_()
        reads.append((name, key, first, flat.narrow(0, offset, count)))
        at = max(at, offset + count)
    if zero_gaps and at < part.numel:
        flat.narrow(0, at, part.numel - at).zero_()
    return flat


def _engine_flat(tensor: torch.Tensor | None, numel: int) -> torch.Tensor | None:
    """The engine's own flat tensor where the checkpoint's values can be read straight into it (in host memory,
    or on its device through :func:`~stagesafe.zero.staged_reads.read_staged`'s bounded host buffer):
    contiguous, of the partition's size."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous() or tensor.numel() != numel:
        return None
    return tensor.detach().view(-1)


def _engine_state(optimizer: Any, master: torch.Tensor) -> Mapping[str, Any]:
    """The torch optimizer's state of the flat partition ``master`` (DeepSpeed makes it when the engine is built:
    Adam's zero moments), or nothing where it is not made yet."""
    inner = getattr(optimizer, "optimizer", None)
    state = getattr(inner, "state", None)
    if not isinstance(state, Mapping) or master not in state:
        return {}
    held = state[master]
    return held if isinstance(held, Mapping) else {}


def _param_groups(engine: Any, source: CheckpointOptimizer | HandoffOptimizer) -> list[dict[str, Any]]:
    """The torch optimizer's param groups as this engine's ``state_dict`` numbers their flat partitions, with
    the checkpoint's hyperparameters (the lr the schedule reached, ...)."""
    optimizer = engine.optimizer
    if _zero3(engine):
        optimizer._set_fp32_optimizer_param_groups()
        try:
            live = optimizer.optimizer.state_dict()["param_groups"]
        finally:
            optimizer._clear_fp32_optimizer_param_groups()
    else:
        live = optimizer.optimizer.state_dict()["param_groups"]
    if source.param_groups is None or not source.restores_hyperparameters:
        return live
    return [{**{k: v for k, v in saved.items() if k != "params"}, "params": group["params"]}
            for saved, group in zip(source.param_groups, live)]


def _frozen(engine: Any, source: CheckpointOptimizer) -> dict[str, torch.Tensor] | None:
    """The frozen parameters as this rank's model states hold them: ZeRO-3 its fragment of each, ZeRO 1/2 the
    whole values; None where the checkpoint left them out (``exclude_frozen_parameters``)."""
    if not source.has_frozen:
        return None
    if not _zero3(engine):
        return source.frozen_fragments()
    import torch.distributed as dist
    from deepspeed.runtime.utils import is_optimized_parameter

    optimizer, names, out = engine.optimizer, _names(engine), {}
    for param in engine.module.parameters():
        if is_optimized_parameter(param) or not hasattr(param, "ds_tensor"):  # as DeepSpeed saves and loads them
            continue
        name = names[id(param)]
        spec = source.specs.get(name)
        if spec is None or spec.kind != "frozen":
            raise CheckpointFormatError(f"{source.tag_url!r} does not hold the frozen parameter {shown(name)}")
        size = param.ds_tensor.numel()
        first = dist.get_rank(group=optimizer._get_param_partition_group(param)) * size
        fragment = torch.zeros(size, dtype=getattr(torch, spec.dtype))
        real = max(0, min(size, int(param.ds_numel) - first))
        source.read_into(name, None, first, fragment.narrow(0, 0, real))
        out[name] = fragment
    return out


def _loss_scaler(live: Any, saved: Any) -> Any:
    """The engine's loss scaler with the checkpoint's values (its scale, iteration counts): the file's object is
    a stand-in, never built from the file's class."""
    scaler = copy.copy(live)
    if isinstance(saved, OpaqueRecord):
        stands_for, attributes = saved._stands_for, saved._attributes
    elif isinstance(saved, Mapping) and isinstance(saved.get("attributes"), Mapping):  # the handoff form's JSON
        stands_for, attributes = str(saved.get("class")), saved["attributes"]
    else:
        return scaler
    if stands_for.rsplit(".", 1)[-1] != type(live).__name__:
        log.warning("stagesafe: the checkpoint's loss scaler is a %s, this engine's a %s: the engine's is kept",
                    stands_for, type(live).__name__)
        return scaler
    for name, value in attributes.items():
        if name in vars(scaler) and type(value) in (int, float, bool):
            setattr(scaler, name, value)
    return scaler


def _model_name(engine: Any) -> str:
    return os.path.basename(engine._get_ckpt_name("", ""))


def _version() -> str:
    from deepspeed.git_version_info import version

    return version
