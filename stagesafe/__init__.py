"""stagesafe: DeepSpeed ZeRO-3 that is safe to reuse across Lightning Trainer stages.

One format everywhere: Hugging Face-style safetensors shards, ``model.safetensors.index.json`` and a
manifest (``stagesafe.json``) with the sha256 of every shard, on any fsspec URL.

Imports are lazy (PEP 562) so that the ``stagesafe`` command line does not pay for Lightning and DeepSpeed.
When Lightning is already imported, the strategy is imported at once, which registers the strategy names
(``Trainer(strategy="stagesafe_deepspeed_stage_3")``); otherwise the first use of
``stagesafe.StageSafeDeepSpeedStrategy`` (or ``import stagesafe.strategy``) registers them.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from .errors import (
    CheckpointFormatError,
    DistributedStageError,
    HandoffCorruptError,
    HandoffExistsError,
    HandoffNotFoundError,
    InvalidArgumentError,
    StageSafeError,
    StaleDeepSpeedStateError,
    StateDictMismatchError,
    StorageBackendError,
    UnsafeCheckpointError,
)

__version__ = "0.1.0"

_LAZY = {
    "StageSafeDeepSpeedStrategy": "stagesafe.strategy",
    "save_state_dict": "stagesafe.store",
    "load_state_dict": "stagesafe.store",
    "read_manifest": "stagesafe.store",
    "verify": "stagesafe.store",
    "restore": "stagesafe.restore",
    "consolidate": "stagesafe.consolidate",
    "load_zero_checkpoint": "stagesafe.consolidate",
    "inspect_checkpoint": "stagesafe.consolidate",
}

__all__ = [
    *_LAZY,
    "StageSafeError",
    "HandoffNotFoundError",
    "HandoffCorruptError",
    "HandoffExistsError",
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


if "lightning.pytorch" in sys.modules:  # the user works with Lightning: register the strategy names now
    importlib.import_module("stagesafe.strategy")
