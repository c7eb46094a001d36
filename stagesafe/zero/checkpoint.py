"""Read a DeepSpeed ZeRO checkpoint folder: find it, describe its tensors, then read them one at a time.

A checkpoint is written by ``engine.save_checkpoint(dir)`` (``dir/latest`` names a tag folder, e.g.
``global_step100``) or by Lightning's ``trainer.save_checkpoint("x.ckpt")`` under DeepSpeed (``x.ckpt/latest``
names ``checkpoint``). The tag folder holds, per data-parallel rank, ``*_optim_states.pt`` (the rank's partition
of the fp32 master weights, next to the Adam moments) and ``*_model_states.pt`` (shapes, buffers, frozen
parameters). The tag folder itself may be passed too.

:func:`open_zero_checkpoint` reads only the pickles' structure (:mod:`stagesafe.zero.rank_file`: an interpreter
of the opcodes DeepSpeed's files use, which runs nothing they name, and no mapping), so no tensor data is read
until :meth:`ZeroCheckpoint.pieces` or :meth:`ZeroCheckpoint.read`.
Every count and size the files hold is checked against the files before anything is allocated: the world size
against the rank files present, each tensor against the bytes its file really holds, each name and shape
against what a state dict can hold. Each read builds one full tensor from the ranks' partitions, exactly as
DeepSpeed's ``utils/zero_to_fp32.py`` does (stage 1/2: the rank partitions of a param group, concatenated;
stage 3: each parameter's slice of every rank, concatenated and unpadded), reading the bytes with ``pread``, so
memory stays bounded by the largest tensor and a file truncated meanwhile is an error, not a crash. Describing
and :meth:`ZeroCheckpoint.pieces` need no torch (dtypes are names, values bytes); :meth:`ZeroCheckpoint.read`,
which returns a tensor, and the client state import it.

Differences from ``zero_to_fp32``: frozen parameters of stage-1 checkpoints (which DeepSpeed does not list in
``frozen_param_shapes``) are read from the saved module, so they are not lost; tied names are reported as
aliases of the tensor they share.
"""

from __future__ import annotations

import argparse
import bisect
import logging
import math
import os
import re
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from typing_extensions import Self

from stagesafe.errors import CheckpointFormatError, StageSafeError, clip, shown
from stagesafe.handoff.fs import basename, is_local, join, resolve, url_of
from stagesafe.handoff.safe_files import read_in
from stagesafe.zero.pickle_globals import (
    FLOATING,
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

__all__ = ["TensorSpec", "ZeroCheckpoint", "open_zero_checkpoint"]

log = logging.getLogger(__name__)

_OPTIM_RE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_Z3_MODEL_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_Z12_MODEL_RE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_MOE_RE = re.compile(r"(expp_rank_\d+_.*_optim_states|layer_\d+_expert_\d+_.*model_states)\.pt")
_PIPE_RE = re.compile(r"layer_\d+-model_\d+-model_states\.pt")
_STATE_FILE_RE = re.compile(r".*_(model|optim)_states\.pt")

# Keys DeepSpeed writes into *_model_states.pt; everything else there is the caller's client_state.
_DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
    }
)
_EXPECTED = (
    "expected a folder with a 'latest' file naming a tag folder that holds '*_model_states.pt' and "
    "'*_optim_states.pt' files, as engine.save_checkpoint(dir) or Lightning's trainer.save_checkpoint(...) under "
    "DeepSpeedStrategy write"
)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the checkpoint as :meth:`ZeroCheckpoint.read` returns it, described without reading it."""

    name: str
    dtype: str  # as torch names it, without "torch.": "float32", "bfloat16", "int64", ...
    shape: tuple[int, ...]
    kind: str  # "buffer", "frozen" (not trained) or "param" (fp32 master weight)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


_CHUNK = 16 * 1024 * 1024  # pieces of a tensor are read from the rank files in runs of at most this many bytes
_MAX_LATEST = 4096  # the 'latest' file holds a tag name
_MAX_RANK = 2**20  # ranks numbered beyond this are not a data-parallel world DeepSpeed writes
_UNFORESEEN = (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError, RuntimeError)


@dataclass(frozen=True)
class _Source:
    """Where a tensor's values are: ``pieces`` is a list of (rank file, its flat tensor, start, length) in output
    order; every tensor was checked against its file."""

    pieces: tuple[tuple[RankFile, TensorRecord, int, int], ...]


class ZeroCheckpoint:
    """An opened ZeRO checkpoint (see :func:`open_zero_checkpoint`); a context manager that closes its files."""

    def __init__(
        self,
        *,
        url: str,
        tag: str,
        tag_url: str,
        layout: str,
        stage: int,
        world_size: int,
        ds_version: str | None,
        specs: dict[str, TensorSpec],
        aliases: dict[str, str],
        sources: dict[str, _Source],
        files: list[RankFile],
        client_state: tuple[RankFile, dict[str, Any], bool],
        staging_dir: str | None,
    ):
        self.url = url  #: the folder as given
        self.tag = tag  #: the tag folder's name, e.g. "global_step100" or Lightning's "checkpoint"
        self.tag_url = tag_url  #: the folder holding the rank files
        self.layout = layout  #: "deepspeed", "lightning" or "tag-folder" (the tag folder was passed)
        self.stage = stage
        self.world_size = world_size
        self.ds_version = ds_version
        self.tensors = specs  #: stored tensors in DeepSpeed's state-dict order: buffers, frozen, trained
        self.aliases = aliases  #: tied name -> the stored name it shares its tensor with
        self._unread_client_state: tuple[RankFile, dict[str, Any], bool] | None = client_state  # read on first use
        self._client_state: dict[str, Any] = {}
        self._sources = sources
        self._files = files
        self._staging_dir = staging_dir

    # -- description --------------------------------------------------------------------------------------------
    @property
    def client_state(self) -> dict[str, Any]:
        """The non-DeepSpeed entries of rank 0's model states (Lightning's, say), their tensors read on first use;
        when the checkpoint was opened trusted, as ``torch.load(weights_only=False)`` gives them."""
        if self._unread_client_state is not None:
            file, states, trusted = self._unread_client_state
            if trusted:
                loaded = file.load_with_torch()
                self._client_state = {k: v for k, v in loaded.items() if k not in _DEEPSPEED_KEYS}
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
        for piece in self._sources[name].pieces:
            file, tensor, start, length = piece
            if tensor.dtype == spec.dtype:  # straight into the tensor's memory
                file.read_into(tensor, start, out[pos : pos + length * tensor.itemsize])
                pos += length * tensor.itemsize
                continue
            for run in _read_in_runs((piece,), spec.dtype):  # a 16-bit buffer read as fp32
                out[pos : pos + len(run)] = run
                pos += len(run)
        return flat.view(spec.shape)

    def pieces(self, name: str) -> Iterator[memoryview]:
        """The tensor ``name``'s flat values in order, as the bytes of consecutive pieces of at most 16 MiB, each
        read from the rank files when the iteration reaches it (iterate once), to be written without joining them
        into one tensor. Needs no torch (a 16-bit buffer is widened to fp32 by :mod:`stagesafe.zero.widen`)."""
        return _read_in_runs(self._sources[name].pieces, self.tensors[name].dtype)

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
    trusted = os.environ.get(TRUST_VARIABLE) == "1" if trust_pickles is None else bool(trust_pickles)
    if trusted:
        log.warning("%s: trusting its pickles (%s=1 or trust_pickles=True): code in them runs", src, TRUST_VARIABLE)
    fs, root = resolve(src, storage_options)
    tag, tag_dir, layout = _locate(fs, root, tag)
    tag_url = url_of(fs, tag_dir)
    names = _list(fs, tag_dir)[0]
    staging = None
    if is_local(fs):
        local_dir = tag_dir
    else:
        staging = local_dir = tempfile.mkdtemp(prefix="stagesafe-src-")
    opened: list[RankFile] = []
    try:
        files = _rank_files(tag_url, names)
        if staging is not None:  # one call: fsspec fetches the files concurrently where the backend can
            names = files.all_names()
            fs.get([join(tag_dir, n) for n in names], [os.path.join(staging, n) for n in names])
        ckpt = _build(
            url=url_of(fs, root),
            tag=tag,
            tag_url=tag_url,
            layout=layout,
            local_dir=local_dir,
            files=files,
            exclude_frozen=exclude_frozen,
            opened=opened,
            trusted=trusted,
        )
    except BaseException as exc:
        for file in opened:
            file.close()
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, _UNFORESEEN) and not isinstance(exc, StageSafeError):
            # A structure no check of _build foresaw: still the input's fault, and said so in one line.
            raise CheckpointFormatError(
                f"{tag_url!r}: the rank files do not hold what DeepSpeed writes ({type(exc).__name__}: "
                f"{clip(str(exc), 160)}); they were crafted or damaged, or written by a DeepSpeed stagesafe does "
                "not read"
            ) from None
        raise
    ckpt._staging_dir = staging
    return ckpt


# -- finding the checkpoint ----------------------------------------------------------------------------------------


def _list(fs: Any, path: str) -> tuple[list[str], list[str]]:
    """(file names, folder names) directly under ``path``."""
    fs.invalidate_cache(path)
    entries = fs.ls(path, detail=True)
    files = sorted(basename(e["name"]) for e in entries if e.get("type") == "file")
    dirs = sorted((basename(e["name"]) for e in entries if e.get("type") == "directory"), key=_natural)
    return files, dirs


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _has_rank_files(fs: Any, path: str) -> bool:
    try:
        return any(_STATE_FILE_RE.fullmatch(n) for n in _list(fs, path)[0])
    except (FileNotFoundError, NotADirectoryError):
        return False


def _locate(fs: Any, root: str, tag: str | None) -> tuple[str, str, str]:
    """``(tag, tag folder path, layout)`` for the checkpoint at ``root``, or a CheckpointFormatError saying why not."""
    url = url_of(fs, root)
    if tag is not None and (not tag or "/" in tag or "\\" in tag or tag in (".", "..")):
        raise CheckpointFormatError(f"tag {tag!r} is not a tag folder name; give the name alone, e.g. 'global_step100'")
    if not fs.exists(root):
        raise CheckpointFormatError(f"{url!r} does not exist; {_EXPECTED}")
    parent = root.rstrip("/").rsplit("/", 1)[0] if "/" in root.rstrip("/") else ""
    if fs.isfile(root):
        name = basename(root)
        if name == "latest" or _STATE_FILE_RE.fullmatch(name) or name in ("zero_to_fp32.py", "zero_to_torch.py"):
            folder = parent
            grand = folder.rstrip("/").rsplit("/", 1)[0] if "/" in folder else ""
            if name != "latest" and grand and fs.isfile(join(grand, "latest")):
                folder = grand
            raise CheckpointFormatError(
                f"{url!r} is a file inside a DeepSpeed checkpoint; pass the checkpoint folder {url_of(fs, folder)!r}"
            )
        raise CheckpointFormatError(f"{url!r} is a file, not a DeepSpeed checkpoint folder; {_EXPECTED}")
    files, dirs = _list(fs, root)
    has_rank_files = any(_STATE_FILE_RE.fullmatch(n) for n in files)
    if "latest" in files:
        chosen = tag
        if chosen is None:
            what = f"{url}/latest"
            named = read_in(fs, root, "latest", limit=_MAX_LATEST, error=CheckpointFormatError, what=what)
            chosen = named.decode("utf-8", "replace").strip()
        if chosen not in dirs:
            where = "the tag asked for (--tag, tag=)" if tag is not None else "its 'latest' file"
            tags = [d for d in dirs if _has_rank_files(fs, join(root, d))]
            hint = f"tags present: {shown(tags[:20], 400)}" if tags else "it holds no tag folder with rank files"
            raise CheckpointFormatError(f"{url!r} has no tag folder {shown(chosen)} (named by {where}); {hint}")
        return chosen, join(root, chosen), "lightning" if chosen == "checkpoint" else "deepspeed"
    if has_rank_files:
        if tag is not None:
            raise CheckpointFormatError(
                f"{url!r} is itself a tag folder (it holds the rank files); drop the tag (--tag, tag=), or pass its parent "
                f"{url_of(fs, parent)!r} with --tag"
            )
        return basename(root), root, "tag-folder"
    tags = [d for d in dirs if _has_rank_files(fs, join(root, d))]
    if tag is not None:
        if tag in dirs and tag in tags:
            return tag, join(root, tag), "deepspeed"
        present = f"tags present: {shown(tags[:20], 400)}"
        hint = present if tags else f"it holds no tag folder with rank files; {_EXPECTED}"
        raise CheckpointFormatError(f"{url!r} has no tag folder {tag!r} (the tag asked for: --tag, tag=); {hint}")
    if tags:
        raise CheckpointFormatError(
            f"{url!r} has no 'latest' file to say which tag to read; pass a tag (--tag, tag=) with one of "
            f"{shown(tags[:20], 400)}"
        )
    inner = [d for d in dirs[:200] if fs.isfile(join(join(root, d), "latest"))]
    if inner:
        examples = ", ".join(repr(url_of(fs, join(root, d))) for d in inner[-3:])
        raise CheckpointFormatError(
            f"{url!r} is not a DeepSpeed checkpoint but holds {len(inner)} of them in sub-folders; pass one, "
            f"e.g. {examples}"
        )
    if parent and (fs.isfile(join(parent, "latest")) or _has_rank_files(fs, parent)):
        raise CheckpointFormatError(
            f"{url!r} is not a DeepSpeed checkpoint; it looks like a sub-folder of the checkpoint "
            f"{url_of(fs, parent)!r}: pass that"
        )
    raise CheckpointFormatError(f"{url!r} is not a DeepSpeed checkpoint: {_EXPECTED}")


@dataclass
class _RankFiles:
    optim: dict[int, str]  # dp rank -> file name
    model: dict[int, str]  # dp rank -> file name (stage 3), or {0: "mp_rank_00_model_states.pt"} (stage 1/2)
    zero3_model: bool

    def all_names(self) -> list[str]:
        return [*self.optim.values(), *self.model.values()]


def _rank_files(tag_url: str, names: Sequence[str]) -> _RankFiles:
    unsupported = [n for n in names if _MOE_RE.fullmatch(n) or _PIPE_RE.fullmatch(n)]
    if unsupported:
        raise CheckpointFormatError(
            f"{tag_url!r} holds {unsupported[:2]}: a mixture-of-experts or pipeline-parallel checkpoint, which "
            "stagesafe does not consolidate (only data-parallel ZeRO checkpoints); use DeepSpeed's ds_to_universal.py"
        )
    optim: dict[int, str] = {}
    kinds: set[bool] = set()
    mp_ranks: set[int] = set()
    z3_model: dict[int, str] = {}
    z12_model: dict[int, str] = {}
    for n in names:
        if m := _OPTIM_RE.fullmatch(n):
            kinds.add(bool(m.group(1)))
            mp_ranks.add(int(m.group(3)))
            if int(m.group(3)) == 0:
                optim[int(m.group(2))] = n
        elif m := _Z3_MODEL_RE.fullmatch(n):
            mp_ranks.add(int(m.group(2)))
            if int(m.group(2)) == 0:
                z3_model[int(m.group(1))] = n
        elif m := _Z12_MODEL_RE.fullmatch(n):
            mp_ranks.add(int(m.group(1)))
            if int(m.group(1)) == 0:
                z12_model[0] = n
    if mp_ranks - {0}:
        raise CheckpointFormatError(
            f"{tag_url!r} holds files of model-parallel ranks {sorted(mp_ranks - {0})} (mp_rank_01...): stagesafe "
            "consolidates data-parallel ZeRO checkpoints only; merge tensor-parallel shards with ds_to_universal.py"
        )
    if len(kinds) > 1:
        raise CheckpointFormatError(
            f"{tag_url!r} holds optimizer files of two runs (bf16_zero_pp_rank_* and zero_pp_rank_*); "
            "remove the stale ones or save the checkpoint again into an empty folder"
        )
    if not optim:
        what = "model states but" if z3_model or z12_model else "no '*_model_states.pt' and"
        raise CheckpointFormatError(
            f"{tag_url!r} holds {what} no '*_optim_states.pt' files: it is not a ZeRO checkpoint (stage 1, 2 or 3), "
            "or the save was interrupted; without ZeRO, DeepSpeed's mp_rank_00_model_states.pt holds the weights "
            "already (torch.load it)"
        )
    if z3_model:
        return _RankFiles(optim=optim, model=z3_model, zero3_model=True)
    if z12_model:
        return _RankFiles(optim=optim, model=z12_model, zero3_model=False)
    raise CheckpointFormatError(
        f"{tag_url!r} has optimizer files but no '*_model_states.pt' file (names, shapes and buffers are there); "
        "was the folder copied partially?"
    )


# -- reading the structure -----------------------------------------------------------------------------------------


class _Structure:
    """Checks of the values a rank file's pickle holds: each refusal names the file and what DeepSpeed writes."""

    def __init__(self, file: RankFile):
        self.file = file

    def bad(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{self.file.display}: {what}; DeepSpeed does not write that: the file was crafted or damaged"
        )

    def mapping(self, value: Any, what: str) -> Mapping:
        if not isinstance(value, Mapping):
            raise self.bad(f"{what} is {shown(value, 80)}, not a dict")
        return value

    def sequence(self, value: Any, what: str) -> Sequence:
        if not isinstance(value, (list, tuple)):
            raise self.bad(f"{what} is {shown(value, 80)}, not a list")
        return value

    def count(self, value: Any, what: str) -> int:
        if type(value) is not int or not 0 <= value <= 2**62:
            raise self.bad(f"{what} is {shown(value, 80)}, not a count")
        return value

    def name(self, value: Any, what: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.bad(f"{what} has the name {shown(value, 80)}, not a non-empty str")
        return value

    def shape(self, value: Any, name: str) -> tuple[int, ...]:
        """A shape of non-negative ints, whose element count stays below 2**62 (it is bounded by the file anyway)."""
        if not isinstance(value, (list, tuple)) or len(value) > 64:
            raise self.bad(f"the shape of {shown(name, 80)} is {shown(value, 80)}, not a list of sizes")
        n = 1
        for d in value:
            if type(d) is not int or d < 0:
                raise self.bad(f"the shape of {shown(name, 80)} is {shown(value, 80)}: sizes are non-negative ints")
            n *= d
            if n > 2**62:
                raise self.bad(f"the shape of {shown(name, 80)} is {shown(value, 80)}, far more elements than any file")
        return tuple(value)


def _load(local_dir: str, name: str, tag_url: str, opened: list[RankFile], trusted: bool) -> tuple[RankFile, dict]:
    file = RankFile(local_dir, name, display=f"{tag_url}/{name}", trusted=trusted)
    opened.append(file)
    if not isinstance(file.content, dict):
        raise CheckpointFormatError(
            f"{tag_url}/{name} holds a {type(file.content).__name__}, not DeepSpeed's dict of states"
        )
    return file, file.content


def _missing_ranks(tag_url: str, have: Mapping[int, str], world_size: int, example: str, what: str) -> None:
    missing = []
    for rank in range(min(world_size, len(have) + 4)):  # the first few missing, whatever world_size claims
        if rank not in have:
            missing.append(rank)
    extra = sorted(r for r in have if r >= world_size)
    if missing:
        names = [re.sub(r"rank_\d+_mp", f"rank_{r}_mp", example) for r in missing[:3]]
        held = len(have) - len(extra)
        raise CheckpointFormatError(
            f"{tag_url!r} is missing rank files {names}{' ...' if world_size - held > 3 else ''}: the checkpoint was "
            f"written by {world_size} ranks (partition_count in rank 0's {what}) but only {held} of their files are "
            "here; a rank's save failed or the folder was copied partially"
        )
    if extra:
        raise CheckpointFormatError(
            f"{tag_url!r} holds files of ranks {shown(extra[:10], 200)} beyond the {world_size} that wrote this "
            "checkpoint; a checkpoint of another run was saved into the same folder: save into an empty folder"
        )


def _world_size(check: _Structure, partition_count: Any) -> int:
    counts = list(partition_count) if isinstance(partition_count, (list, tuple)) else [partition_count]
    if not counts or any(type(c) is not int or not 1 <= c <= _MAX_RANK for c in counts):
        raise check.bad(f"partition_count is {shown(partition_count, 80)}, not a positive number of ranks")
    return max(counts)


def _build(
    *,
    url: str,
    tag: str,
    tag_url: str,
    layout: str,
    local_dir: str,
    files: _RankFiles,
    exclude_frozen: bool,
    opened: list[RankFile],
    trusted: bool,
) -> ZeroCheckpoint:
    first_file, first = _load(local_dir, files.optim[min(files.optim)], tag_url, opened, trusted)
    check = _Structure(first_file)
    osd0 = first.get("optimizer_state_dict")
    if not isinstance(osd0, dict) or "partition_count" not in osd0:
        raise CheckpointFormatError(
            f"{tag_url}/{files.optim[min(files.optim)]} has no ZeRO optimizer state (optimizer_state_dict with "
            "partition_count); it is not a ZeRO checkpoint file"
        )
    stage = _stage(check, osd0, first)
    world_size = _world_size(check, osd0["partition_count"])
    _missing_ranks(tag_url, files.optim, world_size, files.optim[min(files.optim)], "optimizer file")
    if (stage == 3) != files.zero3_model:
        raise CheckpointFormatError(
            f"{tag_url!r}: optimizer files say ZeRO stage {stage} but the model-state files are named for stage "
            f"{'3' if files.zero3_model else '1/2'}; files of two runs are mixed, save into an empty folder"
        )
    groups_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flat: list[list[tuple[RankFile, TensorRecord]]] = []
    for rank in range(world_size):
        if rank == 0 and min(files.optim) == 0:
            file, sd = first_file, first
        else:
            file, sd = _load(local_dir, files.optim[rank], tag_url, opened, trusted)
        rank_check = _Structure(file)
        osd = rank_check.mapping(sd.get("optimizer_state_dict", {}), "optimizer_state_dict")
        groups = rank_check.sequence(osd.get(groups_key), f"{groups_key!r}")
        flat.append([(file, file.check(t, f"{groups_key}[{i}]").flat()) for i, t in enumerate(groups)])
        del sd, osd  # the Adam moments and the rest: never read, dropped with the dict
    paddings = osd0.get("param_alignment_paddings")
    del first, osd0

    if stage == 3:
        _missing_ranks(tag_url, files.model, world_size, files.model[min(files.model)], "optimizer file")
    models = []
    for rank in sorted(files.model):
        models.append(_load(local_dir, files.model[rank], tag_url, opened, trusted))
    model0_file, model0 = models[0]
    check = _Structure(model0_file)
    for key in ("module", "buffer_names", "param_shapes"):
        if key not in model0:
            raise CheckpointFormatError(f"{tag_url}/{files.model[0]} has no {key!r}: it is not a model-states file")
    autoep = model0.get("ds_autoep_layers", model0.get("autoep_layers"))
    if isinstance(autoep, list) and any(
        isinstance(e, dict) and e.get("checkpoint_format") == "zero3_partitioned" for e in autoep
    ):
        raise CheckpointFormatError(
            f"{tag_url!r} is an AutoEP ZeRO-3 partition-native checkpoint, whose experts are partitioned over expert "
            "groups; stagesafe cannot consolidate it: use DeepSpeed's ds_to_universal.py"
        )

    specs: dict[str, TensorSpec] = {}
    sources: dict[str, _Source] = {}

    def add(name: Any, dtype: str, shape: Any, kind: str, pieces: list) -> None:
        name = check.name(name, f"a {kind} tensor")
        if name in specs:
            raise CheckpointFormatError(
                f"{tag_url!r}: tensor {shown(name)} is listed twice (as {specs[name].kind} and {kind})"
            )
        spec = TensorSpec(name, dtype, check.shape(shape, name), kind)
        held = sum(length for _, _, _, length in pieces)
        if held != spec.numel:
            raise CheckpointFormatError(
                f"{tag_url!r}: the rank files hold {held} elements for {shown(name)}, whose shape "
                f"{list(spec.shape)[:8]} needs {spec.numel}; the files do not belong together"
            )
        specs[name] = spec
        sources[name] = _Source(tuple(p for p in pieces if p[3] > 0))

    # Buffers, in the saved module's order; floating ones as fp32, like zero_to_fp32.
    buffer_names = {n for n in check.sequence(list(model0["buffer_names"]), "buffer_names") if isinstance(n, str)}
    module = check.mapping(model0["module"], "module")
    for name, value in module.items():
        if name in buffer_names and isinstance(value, TensorRecord):
            value = model0_file.check(value, f"buffer {shown(name, 80)}")
            dtype = "float32" if value.dtype in FLOATING else value.dtype
            add(name, dtype, value.shape, "buffer", [(model0_file, value.flat(), 0, value.numel)])

    param_shapes = model0["param_shapes"]
    if isinstance(param_shapes, Mapping):
        param_shapes = [param_shapes]
    param_shapes = [
        check.mapping(group, "a group of param_shapes") for group in check.sequence(param_shapes, "param_shapes")
    ]
    trained = {name for group in param_shapes for name in group}
    shared = dict(check.mapping(model0.get("shared_params") or {}, "shared_params"))

    # Frozen parameters.
    frozen_shapes = model0.get("frozen_param_shapes")
    if not exclude_frozen:
        if frozen_shapes:
            for name, shape in check.mapping(frozen_shapes, "frozen_param_shapes").items():
                numel = math.prod(check.shape(shape, name))
                if stage == 3:
                    frags = []
                    for file, sd in models:
                        fragments = _Structure(file).mapping(sd.get("frozen_param_fragments", {}), "frozen fragments")
                        if fragments.get(name) is None:
                            raise CheckpointFormatError(
                                f"{tag_url!r}: a rank's model states lack the frozen parameter {shown(name)}"
                            )
                        frags.append((file, file.check(fragments[name], f"frozen {shown(name, 80)}").flat()))
                    pieces, left = [], numel
                    for file, frag in frags:
                        take = min(frag.numel, left)
                        pieces.append((file, frag, 0, take))
                        left -= take
                    add(name, frags[0][1].dtype, shape, "frozen", pieces)
                else:
                    fragments = check.mapping(model0.get("frozen_param_fragments") or {}, "frozen_param_fragments")
                    if fragments.get(name) is None:
                        raise CheckpointFormatError(
                            f"{tag_url!r}: the model states lack the frozen parameter {shown(name)}"
                        )
                    frag = model0_file.check(fragments[name], f"frozen {shown(name, 80)}").flat()
                    add(name, frag.dtype, shape, "frozen", [(model0_file, frag, 0, frag.numel)])
        elif stage < 3 and frozen_shapes is None:
            # Stage 1 does not list frozen parameters; the saved module holds them whole, in the training dtype.
            for name, value in module.items():
                if (
                    name not in buffer_names
                    and name not in trained
                    and name not in shared
                    and isinstance(value, TensorRecord)
                    and value.numel > 0
                ):
                    value = model0_file.check(value, f"frozen {shown(name, 80)}")
                    add(name, value.dtype, value.shape, "frozen", [(model0_file, value.flat(), 0, value.numel)])

    # Trained parameters: the fp32 master weights.
    if stage == 3:
        _zero3_params(tag_url, check, flat, param_shapes, world_size, add)
    else:
        _zero12_params(tag_url, check, flat, param_shapes, world_size, paddings, add)

    aliases = {
        alias: canonical
        for alias, canonical in shared.items()
        if isinstance(alias, str) and alias and isinstance(canonical, str) and canonical in specs and alias not in specs
    }
    client_state = (model0_file, {k: v for k, v in model0.items() if k not in _DEEPSPEED_KEYS}, trusted)
    ds_version = model0.get("ds_version")
    return ZeroCheckpoint(
        url=url,
        tag=tag,
        tag_url=tag_url,
        layout=layout,
        stage=stage,
        world_size=world_size,
        ds_version=ds_version if isinstance(ds_version, str) and len(ds_version) <= 100 else None,
        specs=specs,
        aliases=aliases,
        sources=sources,
        files=opened,
        client_state=client_state,
        staging_dir=None,
    )


def _stage(check: _Structure, osd: Mapping[str, Any], sd: Mapping[str, Any]) -> int:
    stage = osd.get("zero_stage")
    if stage is None:  # DeepSpeed's BF16_Optimizer (bf16 with ZeRO-1) does not record it; its config does
        config = sd.get("ds_config") or {}
        zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
        stage = zero.get("stage", 1) if isinstance(zero, Mapping) else 1
    if type(stage) is not int or stage not in (1, 2, 3):
        raise check.bad(f"ZeRO stage {shown(stage, 40)} is not one stagesafe reads (1, 2 or 3)")
    return stage


def _ranges(
    parts: Sequence[tuple[RankFile, TensorRecord]], ends: Sequence[int], start: int, length: int
) -> list[tuple[RankFile, TensorRecord, int, int]]:
    """Pieces of the virtual concatenation of the 1-D tensors ``parts``, whose cumulative ends are ``ends``,
    covering ``[start, start + length)``; found by bisection, so many parts cost no more than a few."""
    pieces = []
    i = bisect.bisect_right(ends, start)
    while length > 0 and i < len(parts):
        file, tensor = parts[i]
        begin = ends[i] - tensor.numel
        take = min(start + length, ends[i]) - start
        if take > 0:
            pieces.append((file, tensor, start - begin, take))
            start += take
            length -= take
        i += 1
    return pieces


def _ends(parts: Sequence[tuple[RankFile, TensorRecord]]) -> list[int]:
    ends, total = [], 0
    for _, tensor in parts:
        total += tensor.numel
        ends.append(total)
    return ends


def _zero12_params(
    tag_url: str, check: _Structure, flat: list[list], param_shapes: list, world_size: int, paddings: Any, add
) -> None:
    """Stage 1/2: group ``g`` is the concatenation of every rank's partition ``g``; params lie in it in order."""
    n_groups = len(flat[0])
    if any(len(groups) != n_groups for groups in flat) or len(param_shapes) != n_groups:
        raise CheckpointFormatError(
            f"{tag_url!r}: the rank files disagree on the number of parameter groups "
            f"({shown([len(g) for g in flat], 80)} partitions, {len(param_shapes)} groups of shapes)"
        )
    if paddings is not None:
        paddings = [check.sequence(p, "param_alignment_paddings") for p in check.sequence(paddings, "paddings")]
    align = 2 * world_size  # ZeRO-2 pads each group to a multiple of 2 * world size (as zero_to_fp32 checks)
    for g, shapes in enumerate(param_shapes):
        parts = [flat[r][g] for r in range(world_size)]
        ends = _ends(parts)
        avail = ends[-1] if ends else 0
        pads = paddings[g] if paddings is not None and g < len(paddings) else None
        if paddings is not None and (pads is None or len(pads) != len(shapes)):
            raise CheckpointFormatError(
                f"{tag_url!r}: group {g} has {len(shapes)} params but {len(pads or ())} alignment paddings"
            )
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(check.shape(shape, name))
            if offset + numel > avail:
                raise CheckpointFormatError(
                    f"{tag_url!r}: parameter {shown(name)} ends at element {offset + numel} of group {g}, which "
                    f"holds {avail}; the files do not belong together"
                )
            add(name, parts[0][1].dtype, shape, "param", _ranges(parts, ends, offset, numel))
            offset += numel + (check.count(pads[i], "an alignment padding") if pads is not None else 0)
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise CheckpointFormatError(
                f"{tag_url!r}: the parameters of group {g} take {offset} elements but the ranks hold {avail}; "
                "the files do not belong together"
            )


def _zero3_params(tag_url: str, check: _Structure, flat: list[list], param_shapes: list, world_size: int, add) -> None:
    """Stage 3: each param is split into ``ceil(numel / world)`` elements per rank, at one offset on every rank."""
    ends = [_ends(groups) for groups in flat]
    totals = [e[-1] if e else 0 for e in ends]
    if len(set(totals)) != 1:
        raise CheckpointFormatError(f"{tag_url!r}: the ranks hold partitions of different sizes {shown(totals, 200)}")
    dtype = flat[0][0][1].dtype if flat[0] else "float32"
    offset = 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(check.shape(shape, name))
            part = math.ceil(numel / world_size)
            if offset + part > totals[0]:
                raise CheckpointFormatError(
                    f"{tag_url!r}: parameter {shown(name)} needs elements up to {offset + part} on each rank, which "
                    f"holds {totals[0]}; the files do not belong together"
                )
            pieces = []
            for rank in range(world_size):
                take = max(0, min(part, numel - rank * part))
                pieces.extend(_ranges(flat[rank], ends[rank], offset, take))
            add(name, dtype, shape, "param", pieces)
            offset += part
    if offset != totals[0]:
        raise CheckpointFormatError(
            f"{tag_url!r}: the parameters take {offset} elements per rank but each rank holds {totals[0]}; "
            "the files do not belong together"
        )


def _read_in_runs(pieces: Sequence[tuple[RankFile, TensorRecord, int, int]], dtype: str) -> Iterator[memoryview]:
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
        vars(value).update({k: _materialize(file, v, done, depth + 1) for k, v in vars(value).items()})
        if isinstance(value, OpaqueRecord):
            for part in ("_args", "_state", "_items"):
                setattr(value, part, _materialize(file, getattr(value, part), done, depth + 1))
    else:
        out = tuple(_materialize(file, item, done, depth + 1) for item in value)
    done[id(value)] = out
    return out
