"""stagesafe: DeepSpeed ZeRO-3 that is safe to reuse across Lightning Trainer stages.

One format everywhere: Hugging Face-style safetensors shards, ``model.safetensors.index.json`` and a
manifest (``stagesafe.json``) with the digest of every shard (``xxh3-128-tree``: docs/handoff-format.md), on any
fsspec URL.

``import stagesafe`` loads only the errors: every public function and the strategy load on first use (PEP 562),
so that the ``stagesafe`` command line pays for neither torch, Lightning nor DeepSpeed. The strategy registers
its names (``Trainer(strategy="stagesafe_deepspeed_stage_3")``) whichever of ``import stagesafe`` and
``import lightning`` comes first (:mod:`stagesafe._registration`).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from stagesafe.errors import (
    CheckpointFormatError,
    DistributedStageError,
    EngineReleasedError,
    HandoffCorruptError,
    HandoffExistsError,
    HandoffNotFoundError,
    HandoffNotReadyError,
    HostMemoryError,
    InvalidArgumentError,
    StageSafeError,
    StaleDeepSpeedStateError,
    StateDictMismatchError,
    StorageBackendError,
    StorageTransferError,
    UnsafeCheckpointError,
)

__version__ = "0.1.0"

# public name -> the module that defines it, imported when the name is first used
_LAZY = {
    "StageSafeDeepSpeedStrategy": "stagesafe.strategy",
    "consolidate": "stagesafe.consolidate",
    "inspect_checkpoint": "stagesafe.consolidate",
    "load_zero_checkpoint": "stagesafe.consolidate",
    "restore": "stagesafe.restore",
    "RetryPolicy": "stagesafe.storage.retry",
    "load_state_dict": "stagesafe.handoff.read",
    "read_manifest": "stagesafe.handoff.read",
    "save_state_dict": "stagesafe.publishing.save",
    "verify": "stagesafe.publishing.verify",
}

__all__ = [
    "StageSafeDeepSpeedStrategy",
    "save_state_dict",
    "load_state_dict",
    "read_manifest",
    "verify",
    "restore",
    "consolidate",
    "load_zero_checkpoint",
    "inspect_checkpoint",
    "RetryPolicy",
    "StorageTransferError",
    "StageSafeError",
    "HandoffNotFoundError",
    "HandoffCorruptError",
    "HandoffExistsError",
    "HandoffNotReadyError",
    "InvalidArgumentError",
    "StateDictMismatchError",
    "StaleDeepSpeedStateError",
    "CheckpointFormatError",
    "UnsafeCheckpointError",
    "StorageBackendError",
    "DistributedStageError",
    "EngineReleasedError",
    "HostMemoryError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stagesafe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (and submodules already imported), not the helpers this file imports."""
    submodules = [name for name, value in globals().items() if isinstance(value, types.ModuleType)
                  and getattr(value, "__name__", "").startswith(f"{__name__}.") and not name.startswith("_")]
    return sorted(set(__all__) | set(submodules))


class _Package(types.ModuleType):
    """The package module, which keeps ``stagesafe.consolidate`` and ``stagesafe.restore`` the functions: importing
    the submodules of those names would otherwise bind the modules over them (the import system sets a loaded
    submodule as an attribute of its package), and a lazy name is never looked up once an attribute is set."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == f"{__name__}.{name}":
            return  # the submodule stays reachable as sys.modules["stagesafe.<name>"]
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if "lightning.pytorch" in sys.modules:  # the user works with Lightning: register the strategy names now
    importlib.import_module("stagesafe.strategy")
else:  # or once Lightning is imported, without importing it here (stagesafe._registration says how)
    from stagesafe._registration import register_once_lightning_loads

    register_once_lightning_loads()
