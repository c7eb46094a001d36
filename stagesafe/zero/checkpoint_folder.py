"""Where a DeepSpeed ZeRO checkpoint's rank files are: the tag folder a path names, and its rank files by rank.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` naming a tag folder (e.g. ``global_step100``); Lightning's
``trainer.save_checkpoint("x.ckpt")`` under DeepSpeed writes ``x.ckpt/latest`` naming ``checkpoint``; the tag folder
itself may be passed too. :func:`locate` finds the tag folder, or says in one line what was passed instead and what
to pass (the folder above a rank file, the checkpoints in a folder of checkpoints, the tags present).
:func:`rank_file_names` picks the rank files in it that a data-parallel ZeRO checkpoint has, refusing the layouts
stagesafe does not consolidate (mixture of experts, pipeline or tensor parallel, files of two runs). Only names
are read here, and the ``latest`` file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stagesafe.errors import CheckpointFormatError, shown
from stagesafe.storage.fs import basename, join, url_of
from stagesafe.storage.safe_files import read_in

__all__ = ["RankFileNames", "TagFolder", "file_names", "locate", "rank_file_names"]

_OPTIM_RE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_Z3_MODEL_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_Z12_MODEL_RE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_MOE_RE = re.compile(r"(expp_rank_\d+_.*_optim_states|layer_\d+_expert_\d+_.*model_states)\.pt")
_PIPE_RE = re.compile(r"layer_\d+-model_\d+-model_states\.pt")
_STATE_FILE_RE = re.compile(r".*_(model|optim)_states\.pt")

_EXPECTED = (
    "expected a folder with a 'latest' file naming a tag folder that holds '*_model_states.pt' and "
    "'*_optim_states.pt' files, as engine.save_checkpoint(dir) or Lightning's trainer.save_checkpoint(...) under "
    "DeepSpeedStrategy write"
)
_MAX_LATEST = 4096  # the 'latest' file holds a tag name
_HELPER_FILES = ("zero_to_fp32.py", "zero_to_torch.py")  # scripts DeepSpeed copies into the checkpoint folder


@dataclass(frozen=True)
class TagFolder:
    """The tag folder of a checkpoint, as :func:`locate` found it."""

    tag: str  # its name, e.g. "global_step100" or Lightning's "checkpoint"
    path: str  # on the checkpoint's file system
    layout: str  # "deepspeed", "lightning" or "tag-folder" (the tag folder itself was passed)


@dataclass
class RankFileNames:
    """The rank files of a tag folder, by data-parallel rank."""

    optim: dict[int, str]  # dp rank -> file name
    model: dict[int, str]  # dp rank -> file name (stage 3), or {0: "mp_rank_00_model_states.pt"} (stage 1/2)
    zero3_model: bool  # the model-states files are named for stage 3

    def all_names(self) -> list[str]:
        return [*self.optim.values(), *self.model.values()]


def file_names(fs: Any, path: str) -> list[str]:
    """The names of the files directly under ``path``, sorted."""
    return _list(fs, path)[0]


def locate(fs: Any, root: str, tag: str | None) -> TagFolder:
    """The tag folder of the checkpoint at ``root`` (``tag``: the one asked for, default the one ``latest`` names),
    or a :class:`~stagesafe.errors.CheckpointFormatError` saying what ``root`` is instead and what to pass."""
    url = url_of(fs, root)
    if tag is not None and (not tag or "/" in tag or "\\" in tag or tag in (".", "..")):
        raise CheckpointFormatError(f"tag {tag!r} is not a tag folder name; give the name alone, e.g. 'global_step100'")
    if not fs.exists(root):
        raise CheckpointFormatError(f"{url!r} does not exist; {_EXPECTED}")
    if fs.isfile(root):
        raise _a_file(fs, root, url)
    files, dirs = _list(fs, root)
    if "latest" in files:
        return _named_by_latest(fs, root, url, tag, dirs)
    if any(_STATE_FILE_RE.fullmatch(n) for n in files):
        if tag is not None:
            raise CheckpointFormatError(
                f"{url!r} is itself a tag folder (it holds the rank files); drop the tag (--tag, tag=), or pass its "
                f"parent {url_of(fs, _parent(root))!r} with --tag"
            )
        return TagFolder(basename(root), root, "tag-folder")
    return _asked_for_without_latest(fs, root, url, tag, dirs)


def _named_by_latest(fs: Any, root: str, url: str, tag: str | None, dirs: list[str]) -> TagFolder:
    """The tag folder ``tag`` names, or else the folder's ``latest`` file."""
    chosen = tag
    if chosen is None:
        named = read_in(fs, root, "latest", limit=_MAX_LATEST, error=CheckpointFormatError, what=f"{url}/latest")
        chosen = named.decode("utf-8", "replace").strip()
    if chosen not in dirs:
        where = "the tag asked for (--tag, tag=)" if tag is not None else "its 'latest' file"
        tags = _tags(fs, root, dirs)
        hint = f"tags present: {shown(tags[:20], 400)}" if tags else "it holds no tag folder with rank files"
        raise CheckpointFormatError(f"{url!r} has no tag folder {shown(chosen)} (named by {where}); {hint}")
    return TagFolder(chosen, join(root, chosen), "lightning" if chosen == "checkpoint" else "deepspeed")


def _asked_for_without_latest(fs: Any, root: str, url: str, tag: str | None, dirs: list[str]) -> TagFolder:
    """The tag folder ``tag`` of a folder without ``latest``; without a tag, an error saying what to pass."""
    tags = _tags(fs, root, dirs)
    if tag is not None:
        if tag in tags:
            return TagFolder(tag, join(root, tag), "deepspeed")
        present = f"tags present: {shown(tags[:20], 400)}"
        hint = present if tags else f"it holds no tag folder with rank files; {_EXPECTED}"
        raise CheckpointFormatError(f"{url!r} has no tag folder {tag!r} (the tag asked for: --tag, tag=); {hint}")
    if tags:
        raise CheckpointFormatError(
            f"{url!r} has no 'latest' file to say which tag to read; pass a tag (--tag, tag=) with one of "
            f"{shown(tags[:20], 400)}"
        )
    raise _not_a_checkpoint(fs, root, url, dirs)


def _a_file(fs: Any, root: str, url: str) -> CheckpointFormatError:
    """The error for a file passed as the checkpoint: the checkpoint folder to pass, if it lies in one."""
    name = basename(root)
    if name == "latest" or _STATE_FILE_RE.fullmatch(name) or name in _HELPER_FILES:
        folder = _parent(root)
        grand = folder.rstrip("/").rsplit("/", 1)[0] if "/" in folder else ""
        if name != "latest" and grand and fs.isfile(join(grand, "latest")):
            folder = grand
        return CheckpointFormatError(
            f"{url!r} is a file inside a DeepSpeed checkpoint; pass the checkpoint folder {url_of(fs, folder)!r}"
        )
    return CheckpointFormatError(f"{url!r} is a file, not a DeepSpeed checkpoint folder; {_EXPECTED}")


def _not_a_checkpoint(fs: Any, root: str, url: str, dirs: list[str]) -> CheckpointFormatError:
    """The error for a folder that is no checkpoint: the checkpoints it holds, or the one it lies in, if any."""
    inner = [d for d in dirs[:200] if fs.isfile(join(join(root, d), "latest"))]
    if inner:
        examples = ", ".join(repr(url_of(fs, join(root, d))) for d in inner[-3:])
        return CheckpointFormatError(
            f"{url!r} is not a DeepSpeed checkpoint but holds {len(inner)} of them in sub-folders; pass one, "
            f"e.g. {examples}"
        )
    parent = _parent(root)
    if parent and (fs.isfile(join(parent, "latest")) or _has_rank_files(fs, parent)):
        return CheckpointFormatError(
            f"{url!r} is not a DeepSpeed checkpoint; it looks like a sub-folder of the checkpoint "
            f"{url_of(fs, parent)!r}: pass that"
        )
    return CheckpointFormatError(f"{url!r} is not a DeepSpeed checkpoint: {_EXPECTED}")


def _parent(path: str) -> str:
    """The folder above ``path``; "" at the top."""
    return path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else ""


def _list(fs: Any, path: str) -> tuple[list[str], list[str]]:
    """(file names, folder names) directly under ``path``; folders in natural order (step9 before step10)."""
    fs.invalidate_cache(path)
    entries = fs.ls(path, detail=True)
    files = sorted(basename(e["name"]) for e in entries if e.get("type") == "file")
    dirs = sorted((basename(e["name"]) for e in entries if e.get("type") == "directory"), key=_natural)
    return files, dirs


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _tags(fs: Any, root: str, dirs: list[str]) -> list[str]:
    """The folders of ``dirs`` that hold rank files."""
    return [d for d in dirs if _has_rank_files(fs, join(root, d))]


def _has_rank_files(fs: Any, path: str) -> bool:
    try:
        return any(_STATE_FILE_RE.fullmatch(n) for n in _list(fs, path)[0])
    except (FileNotFoundError, NotADirectoryError):
        return False


def rank_file_names(tag_url: str, names: Sequence[str]) -> RankFileNames:
    """The rank files among ``names`` (the tag folder's files) of model-parallel rank 0, or an error saying why
    they are not a data-parallel ZeRO checkpoint stagesafe reads."""
    unsupported = [n for n in names if _MOE_RE.fullmatch(n) or _PIPE_RE.fullmatch(n)]
    if unsupported:
        raise CheckpointFormatError(
            f"{tag_url!r} holds {unsupported[:2]}: a mixture-of-experts or pipeline-parallel checkpoint, which "
            "stagesafe does not consolidate (only data-parallel ZeRO checkpoints); use DeepSpeed's ds_to_universal.py"
        )
    optim, z3_model, z12_model, kinds, mp_ranks = _by_rank(names)
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
        return RankFileNames(optim=optim, model=z3_model, zero3_model=True)
    if z12_model:
        return RankFileNames(optim=optim, model=z12_model, zero3_model=False)
    raise CheckpointFormatError(
        f"{tag_url!r} has optimizer files but no '*_model_states.pt' file (names, shapes and buffers are there); "
        "was the folder copied partially?"
    )


def _by_rank(names: Sequence[str]) -> tuple[dict[int, str], dict[int, str], dict[int, str], set[bool], set[int]]:
    """From the file names: model-parallel rank 0's optimizer files and stage-3 model files by data-parallel rank,
    its stage-1/2 model file, whether optimizer files are named bf16_ (each kind seen), every model-parallel rank."""
    optim: dict[int, str] = {}
    z3_model: dict[int, str] = {}
    z12_model: dict[int, str] = {}
    kinds: set[bool] = set()
    mp_ranks: set[int] = set()
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
    return optim, z3_model, z12_model, kinds, mp_ranks
