"""What an engine leaves on the module it wraps, and taking it away: a footprint of the module before the engine,
the traces an earlier engine left (``ds_*`` attributes, DeepSpeed's hooks, its ``ZeROOrderedDict``, empty ZeRO-3
placeholders), destroying an engine, and stripping the module back to plain PyTorch. Tensor values are not touched
here (:mod:`.values_in` puts them back)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

from torch import nn

from stagesafe.zero.engine.parameters import named_tensors


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
        if isinstance(hooks, dict):
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
    """Describe every trace of an earlier DeepSpeed engine on the module; empty when the module is clean. (Hook
    tables are checked with ``isinstance(..., dict)``: ``typing.Mapping`` took 4 µs a check, 7 ms a 1.4B model.)

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
            if isinstance(hooks, dict):
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


def destroy_engine(engine: Any) -> None:
    """Let DeepSpeed remove what it registered (module and gradient hooks, by handle)."""
    engine.destroy()


def _release_deepspeed_globals(module: nn.Module) -> None:
    """What DeepSpeed keeps of an engine in its globals after ``destroy()``, let go: ZeRO-3 pushes each engine's
    module on a global stack (``parameter_offload.FWD_MODULE_STACK``) that is never popped (a forward that failed
    leaves its submodules there too), and caches which parameters each submodule releases in an unbounded
    ``lru_cache`` on the coordinator's class. Either keeps the module, its Trainer and all they hold (kept
    optimizer state in page-locked memory) until the process ends; the cache is only a cache."""
    stack = getattr(sys.modules.get("deepspeed.runtime.zero.parameter_offload"), "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        ours = {id(sub) for sub in module.modules()}
        stack[:] = [entry for entry in stack if id(entry) not in ours]
    coordinator = getattr(
        sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator"), "PartitionedParameterCoordinator", None
    )
    release = vars(coordinator).get("_PartitionedParameterCoordinator__params_to_release") if coordinator else None
    cells = getattr(release, "__closure__", None) or ()  # under DeepSpeed's NVTX wrapper
    for cached in (release, getattr(release, "__wrapped__", None), *map(_contents, cells)):
        if callable(getattr(cached, "cache_clear", None)):
            cached.cache_clear()


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def strip_deepspeed_state(module: nn.Module, footprint: ModuleFootprint | None) -> None:
    """Take the module back to plain PyTorch: drop every attribute, hook and container DeepSpeed added.

    Attributes and hooks present in ``footprint`` (taken before the engine) are the user's and are kept;
    without a footprint only what is recognisably DeepSpeed's goes. Tensor values are not touched here.
    """
    params, _ = named_tensors(module)
    _release_deepspeed_globals(module)
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
        attrs = vars(param)
        if before is not None and not before:  # the user set none: everything there is DeepSpeed's (~30 a param)
            attrs.clear()
        else:
            for key in list(attrs):
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
