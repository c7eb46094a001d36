"""Read a DeepSpeed ZeRO checkpoint folder: find it, describe its tensors, then read them one at a time.

A checkpoint is written by ``engine.save_checkpoint(dir)`` (``dir/latest`` names a tag folder, e.g.
``global_step100``) or by Lightning's ``trainer.save_checkpoint("x.ckpt")`` under DeepSpeed (``x.ckpt/latest``
names ``checkpoint``). The tag folder holds, per data-parallel rank, ``*_optim_states.pt`` (the rank's partition
of the fp32 master weights, next to the Adam moments) and ``*_model_states.pt`` (shapes, buffers, frozen
parameters). The tag folder itself may be passed too.

:func:`open_zero_checkpoint` reads only the pickles' structure: every file is memory-mapped and loaded with the
safe unpickler, so no tensor data is read until :meth:`ZeroCheckpoint.read`. Each read builds one full tensor
from the ranks' partitions, exactly as DeepSpeed's ``utils/zero_to_fp32.py`` does (stage 1/2: the rank
partitions of a param group, concatenated; stage 3: each parameter's slice of every rank, concatenated and
unpadded), then gives the mapped pages back, so memory stays bounded by the largest tensor.

Differences from ``zero_to_fp32``: frozen parameters of stage-1 checkpoints (which DeepSpeed does not list in
``frozen_param_shapes``) are read from the saved module, so they are not lost; tied names are reported as
aliases of the tensor they share.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import Self

from stagesafe.handoff.fs import basename, is_local, join, resolve, url_of
from stagesafe.zero.safe_pickle import can_map, release_pages, safe_load
from stagesafe.errors import CheckpointFormatError

__all__ = ["TensorSpec", "ZeroCheckpoint", "open_zero_checkpoint"]

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
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str  # "buffer", "frozen" (not trained) or "param" (fp32 master weight)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class _Source:
    """Where a tensor's values are: ``pieces`` is a list of (flat source tensor, start, length) in output order."""

    pieces: tuple[tuple[torch.Tensor, int, int], ...]


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
        mapped: bool,
        client_state: dict[str, Any],
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
        self.client_state = client_state  #: non-DeepSpeed entries of rank 0's model states (Lightning's, say)
        self._sources = sources
        self._mapped = mapped
        self._staging_dir = staging_dir

    # -- description --------------------------------------------------------------------------------------------
    def state_dict_names(self) -> list[str]:
        """Every name of the state dict, tied names last, as DeepSpeed's reader orders them."""
        return [*self.tensors, *self.aliases]

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors.values())

    # -- reading ------------------------------------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (a stored name, not an alias), newly allocated: no view of the mapped files."""
        spec = self.tensors[name]
        flat = torch.empty(spec.numel, dtype=spec.dtype)
        pos = 0
        for piece in self._views(name):
            flat.narrow(0, pos, piece.numel()).copy_(piece)  # casts a bf16/fp16 buffer to fp32 on the way
            pos += piece.numel()
            self.release(piece)
        if pos != spec.numel:  # pragma: no cover - _build checks every length up front
            raise CheckpointFormatError(f"{self.tag_url!r}: read {pos} of {spec.numel} elements of {name!r}")
        return flat.view(spec.shape)

    def pieces(self, name: str) -> tuple[torch.Tensor, ...] | None:
        """The tensor ``name`` as views of the mapped files, its flat values in order, to be written without
        joining them into a new tensor (hand each to :meth:`release` once used); ``None`` where a piece needs a
        cast (a 16-bit buffer read as fp32) or the files are not mapped: use :meth:`read` then."""
        spec = self.tensors[name]
        parts = self._views(name)
        if not self._mapped or any(part.dtype != spec.dtype for part in parts):
            return None
        return parts

    def _views(self, name: str) -> tuple[torch.Tensor, ...]:
        """The non-empty pieces of ``name``'s flat values, in order, as views of their source tensors."""
        pieces = self._sources[name].pieces
        return tuple(tensor.view(-1).narrow(0, start, length) for tensor, start, length in pieces if length > 0)

    def release(self, piece: torch.Tensor) -> None:
        """Give back the pages of a piece from :meth:`pieces` that has been used."""
        if self._mapped:
            release_pages(piece)

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
        """Drop the mapped files (and the local copy of a remote checkpoint)."""
        self._sources = {}
        self.client_state = {}
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
) -> ZeroCheckpoint:
    """Find and open the DeepSpeed checkpoint at ``src`` (a local path or an fsspec URL).

    ``tag`` picks the tag folder (default: the one the ``latest`` file names). A remote checkpoint's rank files
    are first copied to a local temporary folder (under ``TMPDIR``; deleted on close), since they are read
    memory-mapped. Raises
    :class:`~stagesafe.errors.CheckpointFormatError` saying what was expected when ``src`` is not a checkpoint
    or lacks rank files, :class:`~stagesafe.errors.UnsafeCheckpointError` for a file the safe loader refuses.
    """
    fs, root = resolve(src, storage_options)
    tag, tag_dir, layout = _locate(fs, root, tag)
    tag_url = url_of(fs, tag_dir)
    names = _list(fs, tag_dir)[0]
    staging = None
    if is_local(fs):
        local_dir = tag_dir
    else:
        staging = local_dir = tempfile.mkdtemp(prefix="stagesafe-src-")
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
        )
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
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
        named = fs.cat_file(join(root, "latest")).decode("utf-8", "replace").strip()
        chosen = tag if tag is not None else named
        if chosen not in dirs:
            where = "--tag (tag=)" if tag is not None else "its 'latest' file"
            tags = [d for d in dirs if _has_rank_files(fs, join(root, d))]
            hint = f"tags present: {tags}" if tags else "it holds no tag folder with rank files"
            raise CheckpointFormatError(f"{url!r} has no tag folder {chosen!r} (named by {where}); {hint}")
        return chosen, join(root, chosen), "lightning" if chosen == "checkpoint" else "deepspeed"
    if has_rank_files:
        if tag is not None:
            raise CheckpointFormatError(
                f"{url!r} is itself a tag folder (it holds the rank files); drop --tag (tag=), or pass its parent "
                f"{url_of(fs, parent)!r} with --tag"
            )
        return basename(root), root, "tag-folder"
    tags = [d for d in dirs if _has_rank_files(fs, join(root, d))]
    if tag is not None:
        if tag in dirs and tag in tags:
            return tag, join(root, tag), "deepspeed"
        hint = f"tags present: {tags}" if tags else f"it holds no tag folder with rank files; {_EXPECTED}"
        raise CheckpointFormatError(f"{url!r} has no tag folder {tag!r} (named by --tag (tag=)); {hint}")
    if tags:
        raise CheckpointFormatError(
            f"{url!r} has no 'latest' file to say which tag to read; pass --tag (tag=) with one of {tags}"
        )
    inner = [d for d in dirs[:200] if fs.isfile(join(join(root, d), "latest"))]
    if inner:
        shown = ", ".join(repr(url_of(fs, join(root, d))) for d in inner[-3:])
        raise CheckpointFormatError(
            f"{url!r} is not a DeepSpeed checkpoint but holds {len(inner)} of them in sub-folders; pass one, e.g. {shown}"
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


def _load(local_dir: str, name: str, tag_url: str) -> tuple[Any, bool]:
    path = os.path.join(local_dir, name)
    mapped = can_map(path)
    obj = safe_load(path, mmap=mapped, display_name=f"{tag_url}/{name}")
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{tag_url}/{name} holds a {type(obj).__name__}, not DeepSpeed's dict of states")
    return obj, mapped


def _missing_ranks(tag_url: str, have: Mapping[int, str], world_size: int, example: str, what: str) -> None:
    missing = [r for r in range(world_size) if r not in have]
    extra = sorted(r for r in have if r >= world_size)
    if missing:
        names = [re.sub(r"rank_\d+_mp", f"rank_{r}_mp", example) for r in missing[:3]]
        raise CheckpointFormatError(
            f"{tag_url!r} is missing rank files {names}{' ...' if len(missing) > 3 else ''}: the checkpoint was "
            f"written by {world_size} ranks (partition_count in rank 0's {what}) but only {len(have) - len(extra)} "
            "of their files are here; a rank's save failed or the folder was copied partially"
        )
    if extra:
        raise CheckpointFormatError(
            f"{tag_url!r} holds files of ranks {extra} beyond the {world_size} that wrote this checkpoint; a "
            "checkpoint of another run was saved into the same folder: save into an empty folder"
        )


def _build(
    *, url: str, tag: str, tag_url: str, layout: str, local_dir: str, files: _RankFiles, exclude_frozen: bool
) -> ZeroCheckpoint:
    mapped = True
    first, m = _load(local_dir, files.optim[min(files.optim)], tag_url)
    mapped &= m
    osd0 = first.get("optimizer_state_dict")
    if not isinstance(osd0, dict) or "partition_count" not in osd0:
        raise CheckpointFormatError(
            f"{tag_url}/{files.optim[min(files.optim)]} has no ZeRO optimizer state (optimizer_state_dict with "
            "partition_count); it is not a ZeRO checkpoint file"
        )
    stage = _stage(osd0, first)
    partition_count = osd0["partition_count"]
    world_size = max(partition_count) if isinstance(partition_count, (list, tuple)) else int(partition_count)
    _missing_ranks(tag_url, files.optim, world_size, files.optim[min(files.optim)], "optimizer file")
    if (stage == 3) != files.zero3_model:
        raise CheckpointFormatError(
            f"{tag_url!r}: optimizer files say ZeRO stage {stage} but the model-state files are named for stage "
            f"{'3' if files.zero3_model else '1/2'}; files of two runs are mixed, save into an empty folder"
        )
    groups_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flat: list[list[torch.Tensor]] = []
    for rank in range(world_size):
        if rank == 0 and min(files.optim) == 0:
            sd = first
        else:
            sd, m = _load(local_dir, files.optim[rank], tag_url)
            mapped &= m
        groups = sd.get("optimizer_state_dict", {}).get(groups_key)
        if not isinstance(groups, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in groups):
            raise CheckpointFormatError(f"{tag_url}/{files.optim[rank]} has no '{groups_key}' list of tensors")
        flat.append(list(groups))
        del sd  # the Adam moments and the rest: never read, dropped with the dict
    paddings = osd0.get("param_alignment_paddings")
    del first, osd0

    if stage == 3:
        _missing_ranks(tag_url, files.model, world_size, files.model[min(files.model)], "optimizer file")
    models = []
    for rank in sorted(files.model):
        sd, m = _load(local_dir, files.model[rank], tag_url)
        mapped &= m
        models.append(sd)
    model0 = models[0]
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

    def add(name: str, dtype: torch.dtype, shape: Sequence[int], kind: str, source: _Source) -> None:
        if name in specs:
            raise CheckpointFormatError(
                f"{tag_url!r}: tensor {name!r} is listed twice (as {specs[name].kind} and {kind})"
            )
        spec = TensorSpec(name, dtype, tuple(int(d) for d in shape), kind)
        if sum(length for _, _, length in source.pieces) != spec.numel:
            raise CheckpointFormatError(
                f"{tag_url!r}: the rank files hold {sum(n for _, _, n in source.pieces)} elements for {name!r}, "
                f"whose shape {list(spec.shape)} needs {spec.numel}; the files do not belong together"
            )
        specs[name] = spec
        sources[name] = source

    # Buffers, in the saved module's order; floating ones as fp32, like zero_to_fp32.
    buffer_names = set(model0["buffer_names"])
    module = model0["module"]
    for name, value in module.items():
        if name in buffer_names and isinstance(value, torch.Tensor):
            dtype = torch.float32 if value.is_floating_point() else value.dtype
            add(name, dtype, value.shape, "buffer", _Source(((value, 0, value.numel()),)))

    param_shapes = model0["param_shapes"]
    if isinstance(param_shapes, Mapping):
        param_shapes = [param_shapes]
    trained = {name for group in param_shapes for name in group}
    shared = dict(model0.get("shared_params") or {})

    # Frozen parameters.
    frozen_shapes = model0.get("frozen_param_shapes")
    if not exclude_frozen:
        if frozen_shapes:
            for name, shape in frozen_shapes.items():
                numel = math.prod(shape)
                if stage == 3:
                    frags = [sd.get("frozen_param_fragments", {}).get(name) for sd in models]
                    if any(f is None for f in frags):
                        raise CheckpointFormatError(
                            f"{tag_url!r}: a rank's model states lack the frozen parameter {name!r}"
                        )
                    pieces, left = [], numel
                    for frag in frags:
                        take = min(frag.numel(), left)
                        pieces.append((frag, 0, take))
                        left -= take
                    add(name, frags[0].dtype, shape, "frozen", _Source(tuple(pieces)))
                else:
                    frag = (model0.get("frozen_param_fragments") or {}).get(name)
                    if frag is None:
                        raise CheckpointFormatError(f"{tag_url!r}: the model states lack the frozen parameter {name!r}")
                    add(name, frag.dtype, shape, "frozen", _Source(((frag, 0, frag.numel()),)))
        elif stage < 3 and frozen_shapes is None:
            # Stage 1 does not list frozen parameters; the saved module holds them whole, in the training dtype.
            for name, value in module.items():
                if (
                    name not in buffer_names
                    and name not in trained
                    and name not in shared
                    and isinstance(value, torch.Tensor)
                    and value.numel() > 0
                ):
                    add(name, value.dtype, value.shape, "frozen", _Source(((value, 0, value.numel()),)))

    # Trained parameters: the fp32 master weights.
    if stage == 3:
        _zero3_params(tag_url, flat, param_shapes, world_size, add)
    else:
        _zero12_params(tag_url, flat, param_shapes, world_size, paddings, add)

    aliases = {alias: canonical for alias, canonical in shared.items() if canonical in specs and alias not in specs}
    client_state = {k: v for k, v in model0.items() if k not in _DEEPSPEED_KEYS}
    return ZeroCheckpoint(
        url=url,
        tag=tag,
        tag_url=tag_url,
        layout=layout,
        stage=stage,
        world_size=world_size,
        ds_version=model0.get("ds_version"),
        specs=specs,
        aliases=aliases,
        sources=sources,
        mapped=mapped,
        client_state=client_state,
        staging_dir=None,
    )


def _stage(osd: Mapping[str, Any], sd: Mapping[str, Any]) -> int:
    stage = osd.get("zero_stage")
    if stage is None:  # DeepSpeed's BF16_Optimizer (bf16 with ZeRO-1) does not record it; its config does
        config = sd.get("ds_config") or {}
        stage = (config.get("zero_optimization") or {}).get("stage", 1)
    stage = int(stage)
    if stage not in (1, 2, 3):
        raise CheckpointFormatError(f"ZeRO stage {stage} is not one stagesafe reads (1, 2 or 3)")
    return stage


def _ranges(tensors: Sequence[torch.Tensor], start: int, length: int) -> list[tuple[torch.Tensor, int, int]]:
    """Pieces of the virtual concatenation of 1-D ``tensors`` covering ``[start, start + length)``."""
    pieces = []
    offset = 0
    for t in tensors:
        n = t.numel()
        if length > 0 and start < offset + n and start + length > offset:
            lo = max(start, offset)
            hi = min(start + length, offset + n)
            pieces.append((t, lo - offset, hi - lo))
        offset += n
    return pieces


def _zero12_params(
    tag_url: str, flat: list[list[torch.Tensor]], param_shapes: list, world_size: int, paddings: Any, add
) -> None:
    """Stage 1/2: group ``g`` is the concatenation of every rank's partition ``g``; params lie in it in order."""
    n_groups = len(flat[0])
    if any(len(groups) != n_groups for groups in flat) or len(param_shapes) != n_groups:
        raise CheckpointFormatError(
            f"{tag_url!r}: the rank files disagree on the number of parameter groups "
            f"({[len(g) for g in flat]} partitions, {len(param_shapes)} groups of shapes)"
        )
    align = 2 * world_size  # ZeRO-2 pads each group to a multiple of 2 * world size (as zero_to_fp32 checks)
    for g, shapes in enumerate(param_shapes):
        parts = [flat[r][g].view(-1) for r in range(world_size)]
        avail = sum(p.numel() for p in parts)
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(shapes):
            raise CheckpointFormatError(
                f"{tag_url!r}: group {g} has {len(shapes)} params but {len(pads)} alignment paddings"
            )
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            if offset + numel > avail:
                raise CheckpointFormatError(
                    f"{tag_url!r}: parameter {name!r} ends at element {offset + numel} of group {g}, which holds "
                    f"{avail}; the files do not belong together"
                )
            add(name, parts[0].dtype, shape, "param", _Source(tuple(_ranges(parts, offset, numel))))
            offset += numel + (pads[i] if pads is not None else 0)
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise CheckpointFormatError(
                f"{tag_url!r}: the parameters of group {g} take {offset} elements but the ranks hold {avail}; "
                "the files do not belong together"
            )


def _zero3_params(tag_url: str, flat: list[list[torch.Tensor]], param_shapes: list, world_size: int, add) -> None:
    """Stage 3: each param is split into ``ceil(numel / world)`` elements per rank, at one offset on every rank."""
    per_rank = [[t.view(-1) for t in groups] for groups in flat]
    totals = [sum(t.numel() for t in groups) for groups in per_rank]
    if len(set(totals)) != 1:
        raise CheckpointFormatError(f"{tag_url!r}: the ranks hold partitions of different sizes {totals}")
    offset = 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world_size)
            if offset + part > totals[0]:
                raise CheckpointFormatError(
                    f"{tag_url!r}: parameter {name!r} needs elements up to {offset + part} on each rank, which holds "
                    f"{totals[0]}; the files do not belong together"
                )
            pieces = []
            for rank in range(world_size):
                take = max(0, min(part, numel - rank * part))
                pieces.extend(_ranges(per_rank[rank], offset, take))
            add(name, per_rank[0][0].dtype, shape, "param", _Source(tuple(pieces)))
            offset += part
    if offset != totals[0]:
        raise CheckpointFormatError(
            f"{tag_url!r}: the parameters take {offset} elements per rank but each rank holds {totals[0]}; "
            "the files do not belong together"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
