"""Load DeepSpeed's pickled checkpoint files without running code from them.

DeepSpeed writes ``*_model_states.pt`` and ``*_optim_states.pt`` with ``torch.save``; its own ``zero_to_fp32.py``
reads them with ``weights_only=False``, so a crafted file runs its payload. Here they are read with
``torch.load(weights_only=True)`` and an explicit allow-list of the few non-torch globals such files hold.
Allowed DeepSpeed and Lightning classes are *not imported*: each name maps to an inert stand-in that only keeps
the pickled values, so loading needs neither package and no constructor of theirs runs. Anything else is refused
with :class:`~stagesafe.errors.UnsafeCheckpointError`, naming the file and the global.

Local zip-format files are memory-mapped (``mmap=True``): tensors are views of the file, read only where used;
or loaded on the meta device (``meta=True``), for a reader that reads the bytes itself. A file torch cannot read
(truncated, garbled), or whose allowed objects are built from arguments they refuse, raises
:class:`~stagesafe.errors.CheckpointFormatError`.
"""

from __future__ import annotations

import os
import pickle
import re
import threading
from collections.abc import Iterable
from typing import IO, Any

import torch

from stagesafe.errors import CheckpointFormatError, UnsafeCheckpointError, clip

__all__ = ["ALLOWED_GLOBALS", "OpaqueRecord", "can_map", "safe_load"]


class OpaqueRecord:
    """Stands in for an allow-listed class while unpickling: keeps the pickled attributes, runs no code.

    ``weights_only`` unpickling builds it with ``__new__`` and fills ``__dict__`` from the pickled state (BUILD).
    Each allowed class name gets its own subclass, named after it, so a ``repr`` says what it stood in for.
    """

    _stands_for = "?"

    def __repr__(self) -> str:
        return f"<{self._stands_for} (not imported) {self.__dict__!r:.200}>"


def _stand_in(full_name: str) -> type:
    return type(full_name.rpartition(".")[2], (OpaqueRecord,), {"_stands_for": full_name, "__module__": __name__})


# name as pickled -> what the unpickler builds instead. Keep this list short and explain every entry.
ALLOWED_GLOBALS: dict[str, Any] = {
    # ZeRO optimizer state: the loss scaler object (fp32/bf16: LossScaler; fp16: DynamicLossScaler).
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _stand_in("deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _stand_in(
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    ),
    # ZeRO-1/2 optimizer state: param_slice_mappings values, a small dataclass (numel, start).
    "deepspeed.utils.tensor_fragment.fragment_address": _stand_in("deepspeed.utils.tensor_fragment.fragment_address"),
    # The zero_stage entry, an IntEnum pickled as ZeroStageEnum(<int>): int(<int>) gives the same value.
    "deepspeed.runtime.zero.config.ZeroStageEnum": int,
    # Lightning's client state: hyper_parameters is an AttributeDict (a dict subclass). A plain dict holds the
    # same items; the unpickler fills only plain dicts, so it must be dict itself.
    "lightning.fabric.utilities.data.AttributeDict": dict,
    "lightning_fabric.utilities.data.AttributeDict": dict,
    "pytorch_lightning.utilities.parsing.AttributeDict": dict,
    # save_hyperparameters() of an argparse Namespace.
    "argparse.Namespace": _stand_in("argparse.Namespace"),
}

_SAFE_GLOBALS = [(obj, name) for name, obj in ALLOWED_GLOBALS.items()]
_ZIP_MAGIC = b"PK\x03\x04"
_LOCK = threading.Lock()


def safe_load(
    file: str | os.PathLike | IO[bytes],
    *,
    mmap: bool = True,
    meta: bool = False,
    extra_globals: Iterable[tuple[Any, str]] = (),
    display_name: str | None = None,
) -> Any:
    """``torch.load(file, weights_only=True)`` with stagesafe's allow-list, on the CPU.

    ``mmap=True`` maps a local zip-format file instead of reading it (legacy-format files and file objects are
    read). ``meta=True`` loads every tensor on the meta device instead: no tensor data is read or mapped, and
    each storage's offset in the file is its ``_checkpoint_offset`` (:mod:`stagesafe.zero.checkpoint` reads
    the bytes itself). ``extra_globals`` adds ``(stand_in, "module.Name")`` pairs for a caller that knows a file
    needs them. ``display_name`` is how errors name the file (default: its path). A file that is not a torch
    checkpoint, or whose allowed objects are given arguments they refuse, is a ``CheckpointFormatError``.
    """
    name = display_name or (
        os.fspath(file) if isinstance(file, (str, os.PathLike)) else getattr(file, "name", "<file>")
    )
    use_mmap = mmap and not meta and can_map(file)
    try:
        # safe_globals edits one process-wide set on entry and exit: serialize, so that no thread's exit takes
        # the allow-list away from another thread's load.
        with _LOCK, torch.serialization.safe_globals([*_SAFE_GLOBALS, *extra_globals]):
            return torch.load(file, map_location="meta" if meta else "cpu", weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(_refusal_message(file, name, exc)) from None
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - torch's zip reader on a damaged file, or an allowed class given
        # arguments it refuses (int("x"), dict(3)): whatever the file holds, the caller gets one clear error
        detail = clip(" ".join(str(exc).split()), 200) or type(exc).__name__
        raise CheckpointFormatError(
            f"{name} cannot be read as a torch checkpoint file ({type(exc).__name__}: {detail}); it is damaged, "
            "truncated or not a checkpoint DeepSpeed wrote: was it written or copied completely?"
        ) from None


def can_map(file: Any) -> bool:
    """Whether :func:`safe_load` memory-maps ``file``: a local path to a zip-format (torch >= 1.6) file."""
    if not isinstance(file, (str, os.PathLike)):
        return False
    try:
        with open(file, "rb") as f:
            return f.read(4) == _ZIP_MAGIC
    except OSError:
        return False  # let torch.load raise its own, clearer error


def _refusal_message(file: Any, name: str, exc: Exception) -> str:
    refused = _refused_globals(file, exc)
    if refused:
        what = ("the global " if len(refused) == 1 else "the globals ") + ", ".join(repr(g) for g in refused)
    else:
        inner = str(exc).strip().splitlines()
        detail = next((line for line in inner if "Unsupported" in line or "Trying" in line or "Can only" in line), "")
        what = f"content the safe unpickler does not allow ({detail.strip() or type(exc).__name__})"
    return (
        f"refused to load {name}: it holds {what}, which is not on stagesafe's allow-list for DeepSpeed checkpoint "
        "files; nothing from the file was executed. A file written by DeepSpeed or Lightning does not need it: if "
        "you did not make this file yourself, do not trust it; if you did, report the global to stagesafe"
    )


def _refused_globals(file: Any, exc: Exception) -> list[str]:
    """Every global of the file outside torch's and our allow-lists (falls back to the one named in ``exc``)."""
    found: list[str] = []
    try:
        if not isinstance(file, (str, os.PathLike)):
            file.seek(0)
        found = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(file) if g not in ALLOWED_GLOBALS]
    except Exception:  # noqa: BLE001 - a file too broken to scan: the error from torch.load is all there is
        found = []
    if not found:
        match = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if match:
            found = [match.group(1)]
    return found
