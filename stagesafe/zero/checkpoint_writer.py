"""DeepSpeed ZeRO checkpoint folders written without an engine, for ``trainer.save_checkpoint`` between calls.

Between two Trainer calls there is no engine to ask. :func:`write_engine_checkpoint` writes the files the last
engine built for this rank at the end of its ``fit`` (kept in host memory since, optimizer state included) with
the caller's client state: byte for byte the folder DeepSpeed's ``save_checkpoint`` would have written then.
:func:`write_zero_checkpoint` is the fallback when no such files are kept: what an engine of the same ZeRO stage
writes, as from one rank, with an fp32 partition holding every trainable parameter and no optimizer state; the
file :data:`WEIGHTS_ONLY_MARKER` in the folder says so, for the strategy that loads it. DeepSpeed's own
``load_checkpoint`` and ``convert_zero_checkpoint_to_fp32_state_dict``, ``stagesafe consolidate`` and
``trainer.test(ckpt_path=...)`` read both.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import stat
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stagesafe.errors import InvalidArgumentError

__all__ = [
    "RECOVERY_SCRIPTS",
    "WEIGHTS_ONLY_MARKER",
    "copy_recovery_scripts",
    "write_engine_checkpoint",
    "write_zero_checkpoint",
    "is_weights_only",
    "holds_optimizer_state",
]

WEIGHTS_ONLY_MARKER = "stagesafe_weights_only.json"
_WEIGHTS_ONLY_OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"  # the one optimizer file a weights-only save writes
# What DeepSpeed's engine copies from deepspeed/utils/ into every ZeRO checkpoint folder it saves, on global rank 0
# (0.19: DeepSpeedEngine._copy_recovery_script, from _save_zero_checkpoint): users run them from the folder.
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def write_engine_checkpoint(
    path: str,
    files: Mapping[str, Mapping[str, Any]],
    *,
    client_state: Mapping[str, Any],
    latest: bool,
    tag: str = "checkpoint",
) -> None:
    """Write this rank's kept DeepSpeed checkpoint ``files`` (file name -> state) into ``path``/``tag``, each
    model-states file with ``client_state`` added, as ``engine.save_checkpoint(path, tag, client_state)`` does.
    Every rank calls it with its own files; the one with ``latest`` also writes ``latest`` and removes a
    weights-only marker an earlier save left in the folder. Each file appears under its name only once whole."""
    folder = os.path.join(path, tag)
    os.makedirs(folder, exist_ok=True)
    for name, state in files.items():
        if "model_states" in name:
            state = {**state, **client_state}
        partial = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
        torch.save(dict(state), partial)
        os.replace(partial, os.path.join(folder, name))
    if latest:
        with open(os.path.join(path, "latest"), "w") as f:
            f.write(tag)
        holds_optimizer_state(path)
        copy_recovery_scripts(path)


def copy_recovery_scripts(path: str) -> None:
    """Copy DeepSpeed's :data:`RECOVERY_SCRIPTS` into the checkpoint folder ``path``, executable, as its engine
    does (a script this DeepSpeed does not ship is left out, as it would be)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return  # without DeepSpeed there is no script to copy (the folder is read by stagesafe all the same)
    utils = os.path.join(os.path.dirname(spec.origin), "utils")
    for script in RECOVERY_SCRIPTS:
        source = os.path.join(utils, script)
        if not os.path.isfile(source):
            continue
        target = os.path.join(path, script)
        shutil.copyfile(source, target)
        with contextlib.suppress(OSError):  # a file share may refuse; DeepSpeed goes on too
            os.chmod(target, os.stat(target).st_mode | stat.S_IEXEC)


def holds_optimizer_state(path: str) -> None:
    """A full DeepSpeed checkpoint was just written into ``path``: an earlier weights-only save's marker goes,
    so that a resume from it takes the optimizer state that is there now, and so does that save's optimizer file
    where DeepSpeed named its own otherwise (``bf16_...``, under bf16) instead of writing over it: a folder holding
    both kinds is two runs' files, which stagesafe's reader refuses."""
    marker = os.path.join(path, WEIGHTS_ONLY_MARKER)
    try:
        with open(marker) as f:
            tag = json.load(f).get("tag", "checkpoint")
    except FileNotFoundError:
        return
    except (ValueError, AttributeError):
        tag = "checkpoint"
    folder = os.path.join(path, str(tag))
    if os.path.isfile(os.path.join(folder, f"bf16_{_WEIGHTS_ONLY_OPTIM}")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, _WEIGHTS_ONLY_OPTIM))
    with contextlib.suppress(FileNotFoundError):
        os.remove(marker)


def write_zero_checkpoint(
    path: str,
    module: nn.Module,
    *,
    values: Mapping[str, torch.Tensor] | None = None,
    zero_stage: int,
    client_state: Mapping[str, Any],
    tag: str = "checkpoint",
    exclude_frozen: bool = False,
) -> None:
    """Write ``module``'s weights as a ZeRO ``zero_stage`` checkpoint folder at ``path`` (a local path), with
    ``client_state`` in the model-states file, as an engine's ``save_checkpoint`` does. ``values`` (state-dict
    name -> tensor) stand in for the module's own tensors, e.g. when it holds meta tensors."""
    if zero_stage not in (1, 2, 3):
        raise InvalidArgumentError(f"zero_stage={zero_stage!r}: a ZeRO checkpoint is written for stage 1, 2 or 3")
    weights = _Weights(module, values)
    version = _deepspeed_version()
    model_states: dict[str, Any] = {
        **client_state,
        "module": weights.buffers,
        "buffer_names": list(weights.buffers),
        "param_shapes": [weights.trainable],
        "frozen_param_shapes": None if exclude_frozen else weights.frozen,
        "frozen_param_fragments": None if exclude_frozen else _fragments(weights.values, weights.frozen, zero_stage),
        "shared_params": weights.shared,
        "ds_version": version,
        "dp_world_size": 1,
        "mp_world_size": 1,
    }
    optim_states = {"optimizer_state_dict": _partition(weights, zero_stage), "ds_version": version}
    folder = os.path.join(path, tag)
    os.makedirs(folder, exist_ok=True)
    model_name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero_stage == 3 else "mp_rank_00_model_states.pt"
    torch.save(model_states, os.path.join(folder, model_name))
    torch.save(optim_states, os.path.join(folder, _WEIGHTS_ONLY_OPTIM))
    with open(os.path.join(path, "latest"), "w") as f:
        f.write(tag)
    with open(os.path.join(path, WEIGHTS_ONLY_MARKER), "w") as f:
        json.dump({"written_by": "stagesafe", "weights_only": True, "zero_stage": zero_stage, "tag": tag}, f)
        f.write("\n")
    copy_recovery_scripts(path)


class _Weights:
    """A module's state-dict tensors on the CPU as one rank of an engine holds them: each parameter once (a tied
    name is listed in ``shared``), trainable or frozen, and the persistent buffers. ``given`` (name -> tensor)
    stands in for the module's own tensors."""

    def __init__(self, module: nn.Module, given: Mapping[str, torch.Tensor] | None):
        first: dict[int, str] = {}
        self.shared: dict[str, str] = {}
        self.trainable: OrderedDict[str, torch.Size] = OrderedDict()
        self.frozen: OrderedDict[str, torch.Size] = OrderedDict()
        self.values: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            canonical = first.setdefault(id(param), name)
            if canonical != name:
                self.shared[name] = canonical  # tied: stored once
                continue
            self.values[name] = (given[name] if given is not None else param.detach()).to("cpu")
            (self.trainable if param.requires_grad else self.frozen)[name] = param.shape
        state_keys = set(module.state_dict(keep_vars=True))
        self.buffers = {
            n: (given[n] if given is not None else b.detach()).to("cpu")
            for n, b in module.named_buffers()
            if n in state_keys
        }


def _partition(weights: _Weights, zero_stage: int) -> dict[str, Any]:
    """The optimizer state of the one rank: an fp32 partition holding every trainable parameter, no moments."""
    names = list(weights.trainable)
    flat = torch.cat([weights.values[n].float().reshape(-1) for n in names]) if names else torch.zeros(0)
    if zero_stage <= 2:
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 2)])  # DeepSpeed aligns a group to 2 x world
    groups_key = "fp32_flat_groups" if zero_stage == 3 else "single_partition_of_fp32_groups"
    return {"zero_stage": zero_stage, "partition_count": 1 if zero_stage == 3 else [1], groups_key: [flat]}


def is_weights_only(path: str) -> bool:
    """Whether ``path`` is a checkpoint folder this module wrote (no optimizer state in it)."""
    return os.path.isfile(os.path.join(path, WEIGHTS_ONLY_MARKER))


def _fragments(
    values: Mapping[str, torch.Tensor], frozen: Mapping[str, torch.Size], zero_stage: int
) -> dict[str, torch.Tensor]:
    """Frozen parameters as one rank holds them: whole (stages 1, 2) or as its flat partition (stage 3)."""
    if zero_stage <= 2:
        return {n: values[n] for n in frozen}
    return {n: values[n].reshape(-1) for n in frozen}


def _deepspeed_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "0"

