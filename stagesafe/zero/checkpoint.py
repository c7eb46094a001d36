"""Read a DeepSpeed ZeRO checkpoint folder: open it, then read its tensors one at a time.

:func:`open_zero_checkpoint` finds the tag folder (:mod:`.checkpoint_folder`; ``engine.save_checkpoint(dir)``'s or
Lightning's ``trainer.save_checkpoint("x.ckpt")`` layout, or the tag folder itself), copies a remote one's rank
files to a local folder, and describes every tensor from the pickles' structure alone (:mod:`.checkpoint_tensors`,
through :mod:`.rank_file`'s interpreter, which runs nothing the files name), so no tensor data is read until
:meth:`ZeroCheckpoint.pieces` or :meth:`ZeroCheckpoint.read`. Each read builds one full tensor from the pieces of
the ranks' partitions, reading the bytes with ``pread``, so memory stays bounded by the largest tensor and a file
truncated meanwhile is an error, not a crash. Describing and :meth:`ZeroCheckpoint.pieces` need no torch (dtypes
are names, values bytes); :meth:`ZeroCheckpoint.read`, which returns a tensor, and the client state import it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import Self

from stagesafe.errors import CheckpointFormatError, StageSafeError, clip, shown
from stagesafe.flags import checked_flag, checked_optional_flag
from stagesafe.storage.fs import is_local, join, resolve, url_of
from stagesafe.zero.checkpoint_folder import TagFolder, file_names, locate, rank_file_names
from stagesafe.zero.checkpoint_tensors import CheckpointTensors, Piece, RankFiles, TensorSpec, client_entries, describe
from stagesafe.zero.pickle_globals import (
    ITEMSIZE,
    NamedGlobal,
    OpaqueRecord,
    TensorRecord,
    TorchDevice,
    TorchDType,
    TorchSize,
)
from stagesafe.zero.pickle_reader import TRUST_VARIABLE
from stagesafe.zero.rank_file import RankFile
from stagesafe.zero.widen import to_float32

if TYPE_CHECKING:
    import torch

__all__ = ["TensorSpec", "ZeroCheckpoint", "materialized", "open_zero_checkpoint", "read_in_runs"]

log = logging.getLogger(__name__)

_CHUNK = 16 * 1024 * 1024  # pieces of a tensor are read from the rank files in runs of at most this many bytes
# What a structure no check of the description foresaw raises: still the input's fault (a CheckpointFormatError).
_UNFORESEEN = (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError, RuntimeError)


class ZeroCheckpoint:
    """An opened ZeRO checkpoint (see :func:`open_zero_checkpoint`); a context manager that closes its files."""

    def __init__(
        self,
        *,
        url: str,
        folder: TagFolder,
        tag_url: str,
        tensors: CheckpointTensors,
        files: list[RankFile],
        trusted: bool,
        staging_dir: str | None,
    ):
        self.url = url  #: the folder as given
        self.tag = folder.tag  #: the tag folder's name, e.g. "global_step100" or Lightning's "checkpoint"
        self.tag_url = tag_url  #: the folder holding the rank files
        self.layout = folder.layout  #: "deepspeed", "lightning" or "tag-folder" (the tag folder was passed)
        self.stage = tensors.stage
        self.world_size = tensors.world_size
        self.ds_version = tensors.ds_version
        self.tensors = tensors.specs  #: stored tensors in DeepSpeed's state-dict order: buffers, frozen, trained
        self.aliases = tensors.aliases  #: tied name -> the stored name it shares its tensor with
        # read on first use: (rank 0's model states, their client entries as the pickle reader built them, trusted)
        self._unread_client_state: tuple[RankFile, dict[str, Any], bool] | None = (
            tensors.client_file,
            tensors.client_state,
            trusted,
        )
        self._client_state: dict[str, Any] = {}
        self._sources = tensors.sources
        self.described = tensors  #: every rank file's structure as read (:mod:`.checkpoint_optimizer` reads it)
        self._files = files
        self._staging_dir = staging_dir

    # -- description --------------------------------------------------------------------------------------------
    @property
    def staging_dir(self) -> str | None:
        """The local folder a remote checkpoint's files were staged into (removed on close), None otherwise."""
        return self._staging_dir

    @property
    def client_state(self) -> dict[str, Any]:
        """The non-DeepSpeed entries of rank 0's model states (Lightning's, say), their tensors read on first use;
        when the checkpoint was opened trusted, as ``torch.load(weights_only=False)`` gives them."""
        if self._unread_client_state is not None:
            file, states, trusted = self._unread_client_state
            if trusted:
                loaded = file.load_with_torch()
                self._client_state = client_entries(loaded)
            else:
                self._client_state = {k: _materialize(file, v) for k, v in states.items()}
            self._unread_client_state = None
        return dict(self._client_state)

    def state_dict_names(self) -> list[str]:
        """Every name of the state dict, tied names last, as DeepSpeed's reader orders them."""
        return [*self.tensors, *self.aliases]

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors.values())

    # -- reading ------------------------------------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (a stored name, not an alias), newly allocated (imports torch)."""
        import torch

        spec = self.tensors[name]
        flat = torch.empty(spec.numel, dtype=getattr(torch, spec.dtype))
        out = memoryview(flat.view(torch.uint8).numpy())
        pos = 0
        for piece in self._sources[name]:
            file, tensor, start, length = piece
            if tensor.dtype == spec.dtype:  # straight into the tensor's memory
                file.read_into(tensor, start, out[pos : pos + length * tensor.itemsize])
                pos += length * tensor.itemsize
                continue
            for run in read_in_runs((piece,), spec.dtype):  # a 16-bit buffer read as fp32
                out[pos : pos + len(run)] = run
                pos += len(run)
        return flat.view(spec.shape)

    def pieces(self, name: str) -> Iterator[memoryview]:
        """The tensor ``name``'s flat values in order, as the bytes of consecutive pieces of at most 16 MiB, each
        read from the rank files when the iteration reaches it (iterate once), to be written without joining them
        into one tensor. Needs no torch (a 16-bit buffer is widened to fp32 by :mod:`stagesafe.zero.widen`)."""
        return read_in_runs(self._sources[name], self.tensors[name].dtype)

    def sources(self, name: str) -> tuple[Piece, ...]:
        """The runs of the rank files that hold the stored tensor ``name``'s flat values, in order."""
        return self._sources[name]

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for the stored tensors (default: all, in order), one at a time."""
        for name in self.tensors if names is None else names:
            yield name, self.read(name)

    def load_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole state dict in memory (small models only); tied names share one tensor, as in DeepSpeed's."""
        out = dict(self.iter_tensors())
        for alias, canonical in self.aliases.items():
            out[alias] = out[canonical]
        return out

    def close(self) -> None:
        """Close the rank files (and delete the local copy of a remote checkpoint)."""
        self._sources = {}
        self._unread_client_state, self._client_state = None, {}
        for file in self._files:
            file.close()
        self._files = []
        if self._staging_dir is not None:
            shutil.rmtree(self._staging_dir, ignore_errors=True)
            self._staging_dir = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ZeroCheckpoint({self.url!r}, tag={self.tag!r}, stage={self.stage}, world_size={self.world_size}, "
            f"tensors={len(self.tensors)}, aliases={len(self.aliases)})"
        )


def open_zero_checkpoint(
    src: str,
    *,
    tag: str | None = None,
    exclude_frozen: bool = False,
    storage_options: dict[str, Any] | None = None,
    trust_pickles: bool | None = None,
) -> ZeroCheckpoint:
    """Find and open the DeepSpeed checkpoint at ``src`` (a local path or an fsspec URL).

    ``tag`` picks the tag folder (default: the one the ``latest`` file names). A remote checkpoint's rank files
    are first copied to a local temporary folder (under ``TMPDIR``; deleted on close), since only the bytes of
    the weights are read from them, where they lie. Raises
    :class:`~stagesafe.errors.CheckpointFormatError` saying what was expected when ``src`` is not a checkpoint
    or lacks rank files, :class:`~stagesafe.errors.UnsafeCheckpointError` for a file the safe loader refuses.

    ``trust_pickles`` (default: the environment variable ``STAGESAFE_TRUST_PICKLES`` is ``1``): the files are
    trusted, nothing in them is refused, and :attr:`ZeroCheckpoint.client_state` holds the real objects,
    loaded by ``torch.load(weights_only=False)``, which runs code the file names. Only for files you made.
    """
    trust_pickles = checked_optional_flag("trust_pickles", trust_pickles, default=f"trust if {TRUST_VARIABLE}=1")
    exclude_frozen = checked_flag("exclude_frozen", exclude_frozen)
    trusted = os.environ.get(TRUST_VARIABLE) == "1" if trust_pickles is None else trust_pickles
    if trusted:
        log.warning("%s: trusting its pickles (%s=1 or trust_pickles=True): code in them runs", src, TRUST_VARIABLE)
    fs, root = resolve(src, storage_options)
    folder = locate(fs, root, tag)
    tag_url = url_of(fs, folder.path)
    names = file_names(fs, folder.path)
    staging = None if is_local(fs) else tempfile.mkdtemp(prefix="stagesafe-src-")
    files = RankFiles(folder.path if staging is None else staging, tag_url, trusted=trusted)
    try:
        with _as_format_error(tag_url):
            rank_files = rank_file_names(tag_url, names)
            if staging is not None:  # one call: fsspec fetches the files concurrently where the backend can
                local = rank_files.all_names()
                fs.get([join(folder.path, n) for n in local], [os.path.join(staging, n) for n in local])
            tensors = describe(files, rank_files, exclude_frozen=exclude_frozen)
    except BaseException:  # an interrupt too: the local copy of a remote checkpoint is as large as its rank files
        files.close()
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return ZeroCheckpoint(
        url=url_of(fs, root),
        folder=folder,
        tag_url=tag_url,
        tensors=tensors,
        files=files.opened,
        trusted=trusted,
        staging_dir=staging,
    )


@contextlib.contextmanager
def _as_format_error(tag_url: str) -> Iterator[None]:
    """A structure no check of the description foresaw is still the input's fault: said in one line."""
    try:
        yield
    except _UNFORESEEN as exc:
        if isinstance(exc, StageSafeError):
            raise
        raise CheckpointFormatError(
            f"{tag_url!r}: the rank files do not hold what DeepSpeed writes ({type(exc).__name__}: "
            f"{clip(str(exc), 160)}); they were crafted or damaged, or written by a DeepSpeed stagesafe does "
            "not read"
        ) from None


def materialized(file: RankFile, value: Any) -> Any:
    """``value``, read from ``file``'s pickle by the safe reader, as ``torch.load`` gives it (imports torch): its
    tensors read, sizes, dtypes and devices as torch's; classes stagesafe does not import stay stand-ins."""
    return _materialize(file, value)


def read_in_runs(pieces: Sequence[Piece], dtype: str) -> Iterator[memoryview]:
    """The pieces' elements, in order, as the bytes of ``dtype`` values, read from their files in runs of at most
    ``_CHUNK`` bytes; a piece of a 16-bit float buffer is widened to ``dtype`` float32."""
    for file, tensor, start, length in pieces:
        step = max(1, _CHUNK // max(tensor.itemsize, ITEMSIZE[dtype]))
        for at in range(start, start + length, step):
            run = memoryview(bytearray(min(step, start + length - at) * tensor.itemsize))
            file.read_into(tensor, at, run)
            yield run if tensor.dtype == dtype else to_float32(run, tensor.dtype)


def _materialize(file: RankFile, value: Any, done: dict[int, Any] | None = None, depth: int = 0) -> Any:
    """``value`` (client state as the pickle reader built it) as ``torch.load`` gives it (imports torch): every
    tensor read from ``file``, sizes, dtypes and devices as torch's; inside stand-ins and namespaces too. A value
    the pickle shares (its memo) is converted once and stays shared, so a structure that reuses one list at every
    level costs its size, not 2 ** depth."""
    import torch

    done = {} if done is None else done
    if id(value) in done:
        return done[id(value)]
    if isinstance(value, TensorRecord):
        out: Any = file.materialize(file.check(value, "a tensor of the client state", contiguous=False))
    elif isinstance(value, TorchSize):
        out = torch.Size(value)
    elif isinstance(value, TorchDType):
        out = getattr(torch, value.name)
    elif isinstance(value, TorchDevice):
        try:
            out = torch.device(value.type, value.index)
        except RuntimeError:
            raise CheckpointFormatError(f"{file.display}: the client state holds {shown(value)}, no device torch knows")
    elif not isinstance(value, (dict, list, tuple, OpaqueRecord, argparse.Namespace)) or isinstance(value, NamedGlobal):
        return value
    elif depth > 64:
        raise CheckpointFormatError(f"{file.display}: the client state is nested more than 64 levels deep")
    elif isinstance(value, dict):
        out = done[id(value)] = type(value)() if type(value) in (dict, OrderedDict) else {}
        for key, item in value.items():
            out[key] = _materialize(file, item, done, depth + 1)
    elif isinstance(value, list):
        out = done[id(value)] = []
        out.extend(_materialize(file, item, done, depth + 1) for item in value)
    elif isinstance(value, (OpaqueRecord, argparse.Namespace)):  # the same object, its parts converted
        done[id(value)] = out = value
        if isinstance(value, OpaqueRecord):
            for part in ("_attributes", "_args", "_state", "_items"):
                setattr(value, part, _materialize(file, getattr(value, part), done, depth + 1))
        else:
            vars(value).update({k: _materialize(file, v, done, depth + 1) for k, v in vars(value).items()})
    else:
        out = tuple(_materialize(file, item, done, depth + 1) for item in value)
    done[id(value)] = out
    return out
