"""stagesafe: DeepSpeed ZeRO-3 that is safe to reuse across Lightning Trainer stages.

One format everywhere: Hugging Face-style safetensors shards, ``model.safetensors.index.json`` and a
manifest (``stagesafe.json``) with the digest of every shard (``xxh3-128-tree``: docs/handoff-format.md), on any
fsspec URL.

The strategy is imported lazily (PEP 562) so that the ``stagesafe`` command line does not pay for Lightning
and DeepSpeed; it registers its names (``Trainer(strategy="stagesafe_deepspeed_stage_3")``) as soon as
``lightning.pytorch`` is imported, before or after stagesafe.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from stagesafe.errors import (
    CheckpointFormatError,
    DistributedStageError,
    HandoffCorruptError,
    HandoffExistsError,
    HandoffNotFoundError,
    HandoffNotReadyError,
    InvalidArgumentError,
    StageSafeError,
    StaleDeepSpeedStateError,
    StateDictMismatchError,
    StorageBackendError,
    StorageTransferError,
    UnsafeCheckpointError,
)

__version__ = "0.1.0"

from stagesafe.consolidate import consolidate, inspect_checkpoint, load_zero_checkpoint
from stagesafe.restore import restore
from stagesafe.handoff.store import RetryPolicy, load_state_dict, read_manifest, save_state_dict, verify

# Only the strategy pulls in Lightning and DeepSpeed: it loads on first use, or as soon as Lightning does.
_LAZY = {"StageSafeDeepSpeedStrategy": "stagesafe.strategy"}

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
    return sorted(set(globals()) | set(_LAZY))


class _RegisterWithLightning(importlib.abc.MetaPathFinder):
    """Once ``lightning.pytorch`` has finished importing, import the strategy, which registers its names, so
    ``Trainer(strategy="stagesafe_deepspeed_stage_3")`` works whichever of the two was imported first."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        importlib.import_module("stagesafe.strategy")


if "lightning.pytorch" in sys.modules:  # the user works with Lightning: register the strategy names now
    importlib.import_module("stagesafe.strategy")
else:
    sys.meta_path.insert(0, _RegisterWithLightning())
