"""DeepSpeed ZeRO checkpoint folder -> the handoff format (safetensors shards, index, manifest), shard by shard.

:func:`consolidate` reads the checkpoint lazily (:mod:`stagesafe.zero.checkpoint`) and writes with the handoff's
own steps (:func:`~stagesafe.handoff.plan.plan_specs`, :func:`~stagesafe.handoff.shards.write_shards`,
:func:`~stagesafe.publishing.commit.commit`), so a consolidated checkpoint and a strategy handoff are the same format,
planned and written by the same code. Only the tensors of the shards being written are in memory.
:func:`load_zero_checkpoint` reads a (small) checkpoint into memory instead, and :func:`inspect_checkpoint`
describes a handoff or a ZeRO checkpoint without reading tensor data.

:func:`consolidate` and :func:`inspect_checkpoint` need no torch: dtypes are names, and the checkpoint's bytes go
from the rank files to the shards as they are. Only a cast to another dtype (``dtype="bf16"``) imports torch,
whose rounding defines the result; :func:`load_zero_checkpoint` returns tensors, so it imports torch too.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from stagesafe.handoff.cleanup import files_in_the_way
from stagesafe.handoff.codec import check_tensor
from stagesafe.storage.fs import list_files, resolve, url_of
from stagesafe.handoff.manifest import digest_of
from stagesafe.handoff.names import INDEX_NAME, MANIFEST_NAME, is_shard_name
from stagesafe.handoff.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size
from stagesafe.handoff.plan import HandoffPlan, plan_specs
from stagesafe.handoff.optimizer_state import refuse_other_dtype
from stagesafe.publishing.commit import write_and_replace
from stagesafe.handoff.read import read_manifest
from stagesafe.handoff.shards import Pieces
from stagesafe.errors import (
    CheckpointFormatError,
    HandoffExistsError,
    HandoffNotFoundError,
    InvalidArgumentError,
)
from stagesafe.flags import checked_flag, checked_optional_flag
from stagesafe.consolidate_optimizer import optimizer_state_beside
from stagesafe.zero.checkpoint import ZeroCheckpoint, open_zero_checkpoint
from stagesafe.zero.pickle_globals import FLOATING, ITEMSIZE

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "consolidate",
    "inspect_checkpoint",
    "load_zero_checkpoint",
    "load_zero_checkpoint_with_client_state",
]

DTYPES: dict[str, str] = {  # what --dtype (dtype=) accepts -> the dtype, as torch and the manifest name it
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def consolidate(
    src: str,
    dst: str,
    *,
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    exclude_frozen: bool = False,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    workers: int = 1,
    progress: bool | None = None,
    optimizer: bool = False,
) -> dict[str, Any]:
    """Write the weights of the DeepSpeed checkpoint ``src`` to ``dst`` as safetensors shards; return the manifest.

    ``src`` is a checkpoint folder (``engine.save_checkpoint``'s or Lightning's, ZeRO stage 1, 2 or 3, any world
    size) or its tag folder; ``dst`` a folder. Both are local paths or fsspec URLs (``storage_options`` go to
    both filesystems). The values are the fp32 master weights, buffers and frozen parameters, bit for bit what
    DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` returns; ``dtype`` (``"fp32"``, ``"bf16"``,
    ``"fp16"``) casts every floating tensor, integer buffers stay as they are. Tied names are stored once and
    recorded as aliases in the manifest.

    ``workers`` shards are built and written at a time. The rank files are read one tensor at a time and their
    pages given back, so memory is set by the shard writer: :func:`stagesafe.handoff.shards.write_shard` holds a
    few copies of each shard in flight (see docs/performance.md). ``progress``: a bar on stderr (default: when
    stderr is a terminal). Nothing is left at ``dst`` if it fails; an existing handoff at ``dst`` is replaced
    atomically only with ``overwrite=True``.

    ``optimizer=True`` also writes the optimizer state per parameter into ``dst``/optimizer-<tag> (fp32 moments by
    parameter name, step counts and hyperparameters as JSON; :mod:`stagesafe.handoff.optimizer_state`), committed
    before the weights, whose manifest binds it: ``StageSafeDeepSpeedStrategy(resume_from=dst)`` then continues
    training with it at any number of ranks. The weights stay fp32 (the masters); ``dtype`` must be None or fp32.
    """
    out_dtype = _parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    overwrite, optimizer = checked_flag("overwrite", overwrite), checked_flag("optimizer", optimizer)
    if optimizer:
        refuse_other_dtype(out_dtype)
    progress = checked_optional_flag("progress", progress, default="a bar when stderr is a terminal")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgumentError(f"workers={workers!r} must be a positive int")
    # the source first: a checkpoint that is not there says so before the destination's storage is asked anything
    with open_zero_checkpoint(src, tag=tag, exclude_frozen=exclude_frozen, storage_options=storage_options) as ckpt:
        fs, root = resolve(dst, storage_options)
        created = _check_destination(fs, root)
        taken = files_in_the_way(fs, root, overwrite=overwrite)  # the committed weights' files, if overwritten
        metadata = _metadata(ckpt, out_dtype, exclude_frozen)
        with contextlib.ExitStack() as state:
            if optimizer:  # first, in a folder of its own: the weights' manifest, the commit of both, names it
                metadata["optimizer"] = state.enter_context(optimizer_state_beside(
                    ckpt, fs, root, max_shard_size=limit, workers=workers, progress=progress, source=_source(ckpt),
                    created=created))
            # the commit deletes the state the replaced weights named
            return write_and_replace(fs, root, _plan(ckpt, out_dtype, limit, taken=taken), progress=progress,
                                     what=f"consolidating {ckpt.tag}", metadata=metadata, workers=workers,
                                     remove_root=created, empty_before=not taken)


def load_zero_checkpoint(
    src: str,
    *,
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
    exclude_frozen: bool = False,
    storage_options: dict[str, Any] | None = None,
    trust_pickles: bool | None = None,
) -> dict[str, torch.Tensor]:
    """The fp32 state dict of the DeepSpeed checkpoint ``src``, in memory (tied names share one tensor).

    The same values as :func:`consolidate` writes; use this for models that fit in memory. ``trust_pickles``: see
    :func:`~stagesafe.zero.checkpoint.open_zero_checkpoint`.
    """
    return load_zero_checkpoint_with_client_state(
        src,
        tag=tag,
        dtype=dtype,
        exclude_frozen=exclude_frozen,
        storage_options=storage_options,
        trust_pickles=trust_pickles,
    )[0]


def load_zero_checkpoint_with_client_state(
    src: str,
    *,
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
    exclude_frozen: bool = False,
    storage_options: dict[str, Any] | None = None,
    trust_pickles: bool | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state_dict, client_state)``: :func:`load_zero_checkpoint` plus the entries of rank 0's model states
    that are not DeepSpeed's own (for a Lightning checkpoint: epoch, global_step, loops, callbacks, ...). Objects
    of classes stagesafe does not import are inert stand-ins, unless ``trust_pickles`` (or
    ``STAGESAFE_TRUST_PICKLES=1``) loads them with ``torch.load(weights_only=False)``, which runs code in the file:
    see :func:`~stagesafe.zero.checkpoint.open_zero_checkpoint`."""
    out_dtype = _parse_dtype(dtype)
    with open_zero_checkpoint(
        src, tag=tag, exclude_frozen=exclude_frozen, storage_options=storage_options, trust_pickles=trust_pickles
    ) as ckpt:
        values = {name: _cast(tensor, out_dtype) for name, tensor in ckpt.iter_tensors()}
        for alias, canonical in ckpt.aliases.items():
            values[alias] = values[canonical]
        ordered = {name: values[name] for name in ckpt.state_dict_names()}
        return ordered, dict(ckpt.client_state)


def inspect_checkpoint(
    uri: str, *, tag: str | None = None, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Describe what is at ``uri`` without reading tensor data: a handoff (its manifest) or a ZeRO checkpoint.

    Returns a JSON-plain dict: ``kind`` (``"handoff"`` or ``"deepspeed"``), ``url``, ``tensors`` (a list of
    ``{name, dtype, shape, shard | alias_of | kind}``), ``totals`` and, for a handoff, the ``manifest``.
    """
    fs, root = resolve(uri, storage_options)
    if not fs.exists(root):
        raise HandoffNotFoundError(
            f"{url_of(fs, root)!r} does not exist; pass a handoff folder or a DeepSpeed checkpoint folder"
        )
    try:
        manifest = read_manifest(uri, storage_options=storage_options)
    except HandoffNotFoundError:
        if any(n == INDEX_NAME or is_shard_name(n) for n in list_files(fs, root)):
            raise  # model files without a manifest: the store's message says what happened
        try:
            ckpt = open_zero_checkpoint(uri, tag=tag, storage_options=storage_options)
        except CheckpointFormatError as not_zero:
            raise CheckpointFormatError(f"no stagesafe handoff ({MANIFEST_NAME}) here, and {not_zero}") from None
        with ckpt:
            return _describe_zero(ckpt)
    return _describe_handoff(url_of(fs, root), manifest)


# -- internals -----------------------------------------------------------------------------------------------------


def _parse_dtype(dtype: str | torch.dtype | None) -> str | None:
    """The dtype's name, for a name or alias (``"bf16"``) or a ``torch.dtype`` (then torch is imported already)."""
    if dtype is None:
        return None
    torch = sys.modules.get("torch")
    name = str(dtype) if torch is not None and isinstance(dtype, torch.dtype) else dtype
    key = name.lower().removeprefix("torch.") if isinstance(name, str) else None
    if key in DTYPES:
        return DTYPES[key]
    raise InvalidArgumentError(f"dtype={dtype!r} is not one of fp32, bf16, fp16 (or None to keep DeepSpeed's dtypes)")


def _out_dtype(dtype: str, out: str | None) -> str:
    return out if out is not None and dtype in FLOATING else dtype


def _cast(tensor: torch.Tensor, out: str | None) -> torch.Tensor:
    import torch

    target = _out_dtype(str(tensor.dtype).removeprefix("torch."), out)
    return tensor.to(getattr(torch, target))


def _check_destination(fs: Any, root: str) -> bool:
    """Refuse a destination that is a file; return whether the folder is still to be created."""
    if fs.isfile(root):
        raise HandoffExistsError(f"destination {url_of(fs, root)!r} is a file; give a folder (it is created if missing)")
    return not fs.exists(root)


def _metadata(ckpt: ZeroCheckpoint, out_dtype: str | None, exclude_frozen: bool) -> dict[str, Any]:
    """What the manifest records of a consolidation: the checkpoint it read, and how."""
    return {"source": _source(ckpt), "dtype": out_dtype, "exclude_frozen": bool(exclude_frozen)}


def _source(ckpt: ZeroCheckpoint) -> dict[str, Any]:
    """Which checkpoint ``ckpt`` is: where, which tag, how DeepSpeed laid it out."""
    return {
        "url": ckpt.url,
        "tag": ckpt.tag,
        "layout": ckpt.layout,
        "zero_stage": ckpt.stage,
        "world_size": ckpt.world_size,
        "deepspeed_version": ckpt.ds_version,
    }


class _LazyStateDict(Mapping):
    """The checkpoint's stored tensors as a mapping that reads (and casts) a tensor only when asked for it: the
    rank files' bytes as they are, or a tensor cast by torch to the dtype asked for."""

    def __init__(self, ckpt: ZeroCheckpoint, out: str | None):
        self._ckpt, self._out = ckpt, out
        self.on_read: Callable[[int], Any] | None = None  # told the bytes of each tensor read (a progress bar)

    def __getitem__(self, name: str) -> torch.Tensor | Pieces:
        spec = self._ckpt.tensors[name]
        out = _out_dtype(spec.dtype, self._out)
        if self.on_read is not None:
            self.on_read(spec.numel * ITEMSIZE[out])
        if out == spec.dtype:  # written from the rank files piece by piece, never joined into one tensor
            return Pieces(spec.dtype, spec.shape, self._ckpt.pieces(name))
        return _cast(self._ckpt.read(name), self._out)

    def __iter__(self) -> Iterator[str]:
        return iter(self._ckpt.tensors)

    def __len__(self) -> int:
        return len(self._ckpt.tensors)


def _plan(ckpt: ZeroCheckpoint, out: str | None, limit: int, *, taken: set[str]) -> HandoffPlan:
    """The store's plan for the checkpoint (:func:`~stagesafe.handoff.plan.plan_specs`), made from its description
    (no tensor is read, torch is not imported). Every name, dtype and shape is checked first: what safetensors
    cannot store is refused before a byte is written."""
    specs = {}
    for name in ckpt.state_dict_names():
        spec = ckpt.tensors[ckpt.aliases.get(name, name)]
        specs[name] = {"dtype": _out_dtype(spec.dtype, out), "shape": list(spec.shape)}
        try:
            check_tensor(name, specs[name]["dtype"], spec.shape, where="the checkpoint's state dict")
        except InvalidArgumentError as exc:
            raise CheckpointFormatError(
                f"{ckpt.tag_url!r}: {exc}. Nothing was written; load_zero_checkpoint reads such a tensor into memory"
            ) from None
    sizes = {name: spec.numel * ITEMSIZE[_out_dtype(spec.dtype, out)] for name, spec in ckpt.tensors.items()}
    return plan_specs(
        specs, ckpt.aliases, max_shard_size=limit, taken=taken, state_dict=_LazyStateDict(ckpt, out), sizes=sizes
    )


def _describe_handoff(url: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
    aliases = manifest["aliases"]
    tensors = []
    elements = 0
    for name, meta in manifest["tensors"].items():
        row = {"name": name, "dtype": meta["dtype"], "shape": list(meta["shape"])}
        if name in aliases:
            row["alias_of"] = aliases[name]
        else:
            row["shard"] = manifest["weight_map"][name]
            elements += _numel(meta["shape"])
        tensors.append(row)
    return {
        "kind": "handoff",
        "url": url,
        "tensors": tensors,
        "totals": {
            "tensors": len(tensors) - len(aliases),
            "aliases": len(aliases),
            "elements": elements,
            "bytes": manifest["total_size"],
            "shards": len(manifest["shards"]),
            "file_bytes": sum(rec["size"] for rec in manifest["shards"].values()),
        },
        "manifest": {
            **{k: manifest[k] for k in ("format", "created", "shards", "metadata", "versions")},
            "digest": digest_of(manifest),
        },
    }


def _describe_zero(ckpt: ZeroCheckpoint) -> dict[str, Any]:
    tensors: list[dict[str, Any]] = [
        {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "kind": s.kind}
        for s in ckpt.tensors.values()
    ]
    for alias, canonical in ckpt.aliases.items():
        spec = ckpt.tensors[canonical]
        tensors.append(
            {"name": alias, "dtype": spec.dtype, "shape": list(spec.shape), "alias_of": canonical}
        )
    return {
        "kind": "deepspeed",
        **_source(ckpt),
        "tensors": tensors,
        "totals": {
            "tensors": len(ckpt.tensors),
            "aliases": len(ckpt.aliases),
            "elements": sum(s.numel for s in ckpt.tensors.values()),
            "bytes": ckpt.total_bytes,
            "by_kind": {
                kind: sum(s.numel for s in ckpt.tensors.values() if s.kind == kind)
                for kind in ("param", "frozen", "buffer")
            },
        },
    }


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
