"""The exception family of stagesafe.

Every error derives from :class:`StageSafeError`, and also from the builtin a caller would already catch
(``FileNotFoundError``, ``ValueError``, ...), as fsspec and huggingface_hub do.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "StageSafeError",
    "InvalidArgumentError",
    "HandoffNotFoundError",
    "HandoffCorruptError",
    "HandoffExistsError",
    "HandoffNotReadyError",
    "StateDictMismatchError",
    "StaleDeepSpeedStateError",
    "CheckpointFormatError",
    "UnsafeCheckpointError",
    "StorageBackendError",
    "StorageTransferError",
    "DistributedStageError",
    "EngineReleasedError",
    "clip",
    "shown",
]


class StageSafeError(Exception):
    """Base class of every error raised by stagesafe."""


class InvalidArgumentError(StageSafeError, ValueError):
    """An argument has a value stagesafe cannot use: a size like ``"5XB"``, metadata that is not JSON,
    a state-dict entry that is not a tensor."""


class HandoffNotFoundError(StageSafeError, FileNotFoundError):
    """No committed handoff (no manifest) at the given URL."""


class HandoffCorruptError(StageSafeError, ValueError):
    """A handoff's shards do not match its manifest: a changed byte, a truncated or missing shard."""


class HandoffExistsError(StageSafeError, FileExistsError):
    """The destination already holds a handoff and overwriting was not asked for."""


class HandoffNotReadyError(StageSafeError, RuntimeError):
    """Another rank of this job is still writing the handoff in the background; join it first."""


class StateDictMismatchError(StageSafeError, KeyError):
    """A state dict does not fit the module: missing, unexpected or reshaped keys."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class StaleDeepSpeedStateError(StageSafeError, RuntimeError):
    """A module still carries state of an earlier DeepSpeed engine (``ds_*`` attributes, hooks, empty tensors)."""


class CheckpointFormatError(StageSafeError, ValueError):
    """A folder is not a DeepSpeed checkpoint of a layout stagesafe reads."""


class UnsafeCheckpointError(StageSafeError, ValueError):
    """A pickled checkpoint file holds an object outside the allow-list; it was refused, not executed."""


class StorageBackendError(StageSafeError, ImportError):
    """An fsspec protocol is unknown or its backend package is not installed."""


class StorageTransferError(StageSafeError, OSError):
    """Reading or writing the store failed: transient errors (connection, timeout, throttling, 5xx) outlasted
    the retries, or the store refused the request (no such bucket, access denied). The message names the file
    and the URL; the storage client's own error is the ``__cause__``."""


class DistributedStageError(StageSafeError, RuntimeError):
    """A failure on one or more ranks, raised on every rank so that none of them hangs."""


class EngineReleasedError(StageSafeError, RuntimeError):
    """The DeepSpeed engine was asked for after the Trainer call that built it returned: stagesafe destroys it
    there, and the module, its handoff and ``trainer.save_checkpoint`` hold what it held."""


def shown(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to about ``limit`` characters, for an error message: a value read from a file may be
    megabytes long, and a message is one line. A container is shown a few levels and items deep only: a pickle
    can nest lists that share their items, whose whole ``repr`` doubles with each level. Never raises: a value
    too deep or too large to ``repr`` (an integer of millions of digits) is named by its type."""
    try:
        text = _BOUNDED.repr(value) if isinstance(value, (list, tuple, dict, set, frozenset)) else repr(value)
    except Exception:  # noqa: BLE001 - RecursionError, ValueError (int digits), an odd object's own __repr__
        return f"<a {type(value).__name__} that cannot be shown>"
    return clip(text, limit)


class _BoundedRepr(reprlib.Repr):
    """``reprlib``'s bounded repr, for ordered dicts too (by default their own unbounded repr)."""

    def repr_OrderedDict(self, value: Any, level: int) -> str:  # noqa: N802 - reprlib dispatches on the type name
        return self.repr_dict(value, level)


_BOUNDED = _BoundedRepr()
_BOUNDED.maxlevel = 4
_BOUNDED.maxdict = _BOUNDED.maxlist = _BOUNDED.maxtuple = _BOUNDED.maxset = _BOUNDED.maxfrozenset = 20
_BOUNDED.maxstring = _BOUNDED.maxlong = _BOUNDED.maxother = 200


def clip(text: str, limit: int = 120) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[: max(limit - 16, 8)]}... ({len(text)} chars)"
