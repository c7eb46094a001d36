"""stagesafe: DeepSpeed ZeRO-3 that is safe to reuse across Lightning Trainer stages.

One format everywhere: Hugging Face-style safetensors shards, ``model.safetensors.index.json`` and a
manifest (``stagesafe.json``) with the sha256 of every shard, on any fsspec URL.
"""

from .errors import (
    CheckpointFormatError,
    DistributedStageError,
    HandoffCorruptError,
    HandoffExistsError,
    HandoffNotFoundError,
    StageSafeError,
    StaleDeepSpeedStateError,
    StateDictMismatchError,
    StorageBackendError,
    UnsafeCheckpointError,
)
from .restore import restore
from .store import load_state_dict, read_manifest, save_state_dict, verify
from .strategy import StageSafeDeepSpeedStrategy

__version__ = "0.1.0"

__all__ = [
    "StageSafeDeepSpeedStrategy",
    "save_state_dict",
    "load_state_dict",
    "read_manifest",
    "verify",
    "restore",
    "StageSafeError",
    "HandoffNotFoundError",
    "HandoffCorruptError",
    "HandoffExistsError",
    "StateDictMismatchError",
    "StaleDeepSpeedStateError",
    "CheckpointFormatError",
    "UnsafeCheckpointError",
    "StorageBackendError",
    "DistributedStageError",
    "__version__",
]
