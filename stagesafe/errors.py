"""The exception family of stagesafe.

Every error derives from :class:`StageSafeError`, and also from the builtin a caller would already catch
(``FileNotFoundError``, ``ValueError``, ...), as fsspec and huggingface_hub do.
"""

from __future__ import annotations

from stagesafe._shown import clip, shown

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
    "HostMemoryError",
    "clip",
    "describe",
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
    """The handoff is still being written: by this job in the background (join it first), or by another writer
    that replaced it again each time it was read (read it again once that writer is done)."""


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
    """A failure on one or more ranks, raised on every rank so that none of them hangs.

    ``failures`` maps each failed rank to what it reported (as torch.distributed.checkpoint's
    ``CheckpointException.failures`` does), so a caller can tell which ranks failed without parsing the message;
    it is empty where a rank did not answer at all (the message names those)."""

    def __init__(self, message: str, *, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})

    def __reduce__(self):  # keep ``failures`` through pickling (a multiprocessing pool, a spawned test)
        return (_distributed_stage_error, (str(self), self.failures))


def _distributed_stage_error(message: str, failures: dict[int, str]) -> DistributedStageError:
    return DistributedStageError(message, failures=failures)


class EngineReleasedError(StageSafeError, RuntimeError):
    """The DeepSpeed engine was asked for after the Trainer call that built it returned: stagesafe destroys it
    there, and the module, its handoff and ``trainer.save_checkpoint`` hold what it held."""


class HostMemoryError(StageSafeError, MemoryError):
    """A training stage's end would need more host memory than the host can give; raised on every rank before
    the stage's first step, naming the bytes and the ways out, instead of a kernel's out-of-memory kill later."""


def describe(exc: BaseException) -> str:
    """What a rank reports of its failure to the other ranks (a ``failures`` value): the error's type and message."""
    return f"{type(exc).__name__}: {exc}"
