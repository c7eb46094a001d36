"""Handoff storage: a state dict as safetensors shards + Hugging Face index + manifest, on any fsspec URL.

The one writer and reader of the format, used by the strategy, the CLI and the public functions alike.
Writing is split into steps, :func:`plan_handoff`, :func:`write_shard`, :func:`commit`, so that ranks can each
write their own shards and one rank commits; :func:`save_state_dict` composes them.

Commit protocol: shards are written under names the committed handoff does not use, then the index, then the
manifest ``stagesafe.json``, whose presence and content define the handoff; only after it, the previous
generation's files are deleted. A reader sees the old handoff or the new one, never a mix.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import platform
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import fsspec
import safetensors
import safetensors.torch
import torch

from stagesafe._fs import basename, fsync_dir, join, list_files, resolve, url_of, write_atomic
from stagesafe._planning import (
    INDEX_NAME,
    MANIFEST_NAME,
    SAFETENSORS_DTYPES,
    build_index,
    build_manifest,
    check_metadata,
    is_shard_name,
    is_temp_name,
    parse_size,
    plan_shards,
    shard_file_names,
    shard_names,
    validate_manifest,
)
from stagesafe.errors import HandoffCorruptError, HandoffExistsError, HandoffNotFoundError, InvalidArgumentError

__all__ = [
    "HandoffPlan",
    "ShardRecord",
    "commit",
    "live_files",
    "load_state_dict",
    "plan_handoff",
    "read_manifest",
    "save_state_dict",
    "verify",
    "write_shard",
]

log = logging.getLogger(__name__)

_SUPPORTED_DTYPES = frozenset(SAFETENSORS_DTYPES.values())
_CHUNK = 16 * 1024 * 1024  # verify hashes in chunks of this size: memory stays bounded whatever the shard size
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on a header


@dataclass(frozen=True)
class ShardRecord:
    """What :func:`commit` needs to know of a written shard. Plain data, so ranks can gather it."""

    sha256: str
    size: int


@dataclass(frozen=True)
class HandoffPlan:
    """Which tensor goes to which shard file, decided before anything is written."""

    shards: dict[str, list[str]]  # shard file -> names stored in it, in state-dict order
    weight_map: dict[str, str]  # stored name -> shard file (Hugging Face's index)
    tensors: dict[str, dict[str, Any]]  # every name, aliases too, in state-dict order -> {"dtype", "shape"}
    aliases: dict[str, str]  # tied name -> the name it is stored under
    total_size: int  # bytes of tensor data stored
    state_dict: Mapping[str, torch.Tensor] = field(repr=False, compare=False)

    def shard_tensors(self, file_name: str) -> dict[str, torch.Tensor]:
        """The tensors :func:`write_shard` writes into ``file_name``."""
        return {name: self.state_dict[name] for name in self.shards[file_name]}


def plan_handoff(
    state_dict: Mapping[str, torch.Tensor],
    *,
    max_shard_size: int | str = "5GB",
    taken: Iterable[str] = (),
    tag: str | None = None,
) -> HandoffPlan:
    """Plan the shards of ``state_dict``, with file names that avoid ``taken`` (see :func:`live_files`).

    Names that are the very same tensor view (tied weights) are stored once, under the first name; the others
    become aliases. ``tag`` fixes the generation tag when one is needed, so that several ranks plan alike.
    """
    limit = parse_size(max_shard_size)
    if not isinstance(state_dict, Mapping):
        raise InvalidArgumentError(
            f"state_dict must be a mapping of str to torch.Tensor, got {type(state_dict).__name__}"
        )
    tensors: dict[str, dict[str, Any]] = {}
    aliases: dict[str, str] = {}
    first_of: dict[tuple, str] = {}
    entries: list[tuple[str, int]] = []
    for name, tensor in state_dict.items():
        _check_entry(name, tensor)
        tensors[name] = {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)}
        key = _view_identity(tensor)
        if key is not None:
            canonical = first_of.setdefault(key, name)
            if canonical != name:
                aliases[name] = canonical
                continue
        entries.append((name, tensor.numel() * tensor.element_size()))
    groups = plan_shards(entries, limit)
    files = shard_file_names(len(groups), taken=taken, tag=tag)
    shards = dict(zip(files, groups, strict=True))
    return HandoffPlan(
        shards=shards,
        weight_map={name: file for file, names in shards.items() for name in names},
        tensors=tensors,
        aliases=aliases,
        total_size=sum(size for _, size in entries),
        state_dict=state_dict,
    )


def write_shard(
    fs: fsspec.AbstractFileSystem, root: str, file_name: str, tensors: Mapping[str, torch.Tensor]
) -> ShardRecord:
    """Write one shard file under ``root``, atomically, and return its hash and size for the manifest.

    Holds one shard's bytes in memory at a time. Tensors are moved to the CPU and made contiguous; tensors whose
    bytes overlap (views of one another) are written as independent copies, which safetensors requires.
    """
    if not is_shard_name(file_name):
        raise InvalidArgumentError(
            f"file_name={file_name!r} is not a shard name of the format; take it from a HandoffPlan"
        )
    data = safetensors.torch.save(_prepare(tensors), metadata={"format": "pt"})  # "pt": transformers insists
    record = ShardRecord(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    write_atomic(fs, join(root, file_name), data)
    return record


def commit(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    shard_records: Mapping[str, ShardRecord],
    *,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Publish a handoff whose shards are all written: index, then manifest, then delete what is stale.

    Stale: shard files the new manifest does not use (the previous generation, or an interrupted writer's) and
    temporary files of killed writers. Returns the manifest.
    """
    url = url_of(fs, root)
    unwritten = [f for f in plan.shards if f not in shard_records]
    unplanned = [f for f in shard_records if f not in plan.shards]
    if unwritten or unplanned:
        raise InvalidArgumentError(
            f"cannot commit {url!r}: planned shards not written {unwritten[:3]}, written shards not planned "
            f"{unplanned[:3]}; write every shard of the plan with write_shard, then commit"
        )
    manifest = build_manifest(
        shards={f: {"sha256": shard_records[f].sha256, "size": shard_records[f].size} for f in plan.shards},
        weight_map=plan.weight_map,
        tensors=plan.tensors,
        aliases=plan.aliases,
        total_size=plan.total_size,
        metadata=metadata,
        versions=_versions(),
        created=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
    )
    fsync_dir(fs, root)  # the shards' renames are durable before the manifest can name them
    index = build_index(plan.weight_map, plan.total_size)
    write_atomic(fs, join(root, INDEX_NAME), (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    write_atomic(fs, join(root, MANIFEST_NAME), (json.dumps(manifest, indent=2) + "\n").encode())
    fsync_dir(fs, root)
    _remove_stale(fs, root, keep=set(manifest["shards"]))
    return manifest


def live_files(fs: fsspec.AbstractFileSystem, root: str) -> set[str]:
    """Files the committed handoff at ``root`` uses, which a new handoff must not overwrite.

    If the manifest cannot be read, every file present counts as live: better a tagged name than a clobbered file.
    """
    try:
        return set(_read_manifest(fs, root)["shards"])
    except HandoffNotFoundError:
        return set()
    except HandoffCorruptError:
        return set(list_files(fs, root))


def save_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    uri: str,
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = True,
) -> dict[str, Any]:
    """Save ``state_dict`` as a handoff at ``uri``, replacing the one there atomically; return the manifest.

    ``metadata`` (JSON values) is stored in the manifest. With ``overwrite=False`` an existing handoff is an error.
    """
    fs, root = resolve(uri, storage_options)
    metadata = check_metadata(metadata)  # before anything is written
    if not overwrite:
        present = [n for n in list_files(fs, root) if n in (MANIFEST_NAME, INDEX_NAME) or is_shard_name(n)]
        if present:
            what = "a handoff" if MANIFEST_NAME in present else f"model files {sorted(present)[:3]}"
            raise HandoffExistsError(
                f"{url_of(fs, root)!r} already holds {what}; pass overwrite=True (CLI: --overwrite) to replace it, "
                "or choose another folder"
            )
    plan = plan_handoff(state_dict, max_shard_size=max_shard_size, taken=live_files(fs, root))
    records: dict[str, ShardRecord] = {}
    try:
        for file_name in plan.shards:
            records[file_name] = write_shard(fs, root, file_name, plan.shard_tensors(file_name))
    except BaseException:
        for file_name in records:  # never a live file: the plan's names avoid those
            _remove(fs, join(root, file_name))
        raise
    return commit(fs, root, plan, records, metadata=metadata)


def read_manifest(uri: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of the committed handoff at ``uri`` (validated, shards not checked)."""
    fs, root = resolve(uri, storage_options)
    return _read_manifest(fs, root)


def load_state_dict(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Load the committed handoff at ``uri``, every shard checked against the manifest before it is parsed.

    Reads one shard at a time. Tied names come back as the same tensor object, in the order they were saved.
    """
    fs, root = resolve(uri, storage_options)
    manifest = _read_manifest(fs, root)
    for _ in range(3):
        try:
            return _load(fs, root, manifest, torch.device(device))
        except _ShardVanished as exc:
            # A writer may have committed a new handoff and deleted this one's shards while we read: start over
            # from the new manifest. If the manifest is unchanged, the shard is really missing.
            newer = _read_manifest(fs, root)
            if newer == manifest:
                raise HandoffCorruptError(str(exc)) from None
            manifest = newer
    raise HandoffCorruptError(f"{url_of(fs, root)!r} was replaced three times while being read; load it again later")


def verify(uri: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Re-hash every shard of the handoff at ``uri`` against its manifest, check their contents and the index.

    Streams each shard, so memory stays bounded. Raises ``HandoffCorruptError`` naming the shard and what
    differs; returns the manifest.
    """
    fs, root = resolve(uri, storage_options)
    fs.invalidate_cache(root)  # sizes must come from the store, not from a listing cached before a write
    url = url_of(fs, root)
    manifest = _read_manifest(fs, root)
    by_shard = shard_names(manifest["weight_map"], list(manifest["shards"]))
    for file_name, rec in manifest["shards"].items():
        path = join(root, file_name)
        try:
            size = fs.size(path)
        except FileNotFoundError:
            raise HandoffCorruptError(_missing_message(url, file_name)) from None
        _check_bytes(url, file_name, rec, size, None)
        digest, header = _hash_file(fs, path, size)
        _check_bytes(url, file_name, rec, size, digest)
        try:
            entries = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
            found = {k: (SAFETENSORS_DTYPES.get(v["dtype"], v["dtype"]), v["shape"]) for k, v in entries.items()}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise HandoffCorruptError(
                f"{url!r}: shard {file_name!r} has an unreadable safetensors header ({exc})"
            ) from None
        _check_contents(url, file_name, by_shard[file_name], found, manifest["tensors"])
    _check_index(fs, root, manifest)
    return manifest


# -- internals --------------------------------------------------------------------------------------------------


class _ShardVanished(Exception):
    """A shard named by the manifest is not there (replaced by a newer handoff, or lost)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_entry(name: Any, tensor: Any) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"state_dict key {name!r} must be a non-empty str; safetensors names tensors by str")
    where = f"state_dict[{name!r}]"
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(
            f"{where} is a {type(tensor).__name__}, not a torch.Tensor; a handoff stores tensors only "
            "(drop the entry, or put JSON values in metadata)"
        )
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(
            f"{where} has layout {tensor.layout}; safetensors stores dense tensors: pass .to_dense()"
        )
    if tensor.device.type == "meta":
        raise InvalidArgumentError(
            f"{where} is on the meta device and has no data (a ZeRO-3 parameter that was not gathered?); "
            "gather the full weights first"
        )
    if _dtype_name(tensor.dtype) not in _SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            f"{where} has dtype {tensor.dtype}, which safetensors cannot store; convert it first"
        )


def _view_identity(tensor: torch.Tensor) -> tuple | None:
    """Equal for two tensors exactly when they are the same view of the same memory (tied weights)."""
    if tensor.numel() == 0:
        return None  # empty tensors share no bytes; distinct ones may even report the same null pointer
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _prepare(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        out[name] = tensor if tensor.is_contiguous() else tensor.contiguous()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes, name) for name, t in out.items() if t.numel())
    end_so_far = 0
    for start, end, name in spans:
        if start < end_so_far:  # overlaps a tensor already kept: write a copy of its own
            out[name] = out[name].clone()
        end_so_far = max(end_so_far, end)
    return out


@functools.cache
def _versions() -> dict[str, str | None]:
    def dist(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "fsspec": fsspec.__version__,
        "stagesafe": dist("stagesafe") or getattr(sys.modules.get("stagesafe"), "__version__", None),
    }
    for name in ("deepspeed", "lightning", "pytorch-lightning"):  # metadata only: importing them is slow
        if (version := dist(name)) is not None:
            versions[name] = version
    return versions


def _read_manifest(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, Any]:
    url = url_of(fs, root)
    try:
        raw = fs.cat_file(join(root, MANIFEST_NAME))
    except (FileNotFoundError, NotADirectoryError):
        raise HandoffNotFoundError(_not_found_message(fs, root)) from None
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HandoffCorruptError(
            f"{url}/{MANIFEST_NAME} is not valid JSON ({exc}); it was damaged or edited, write the handoff again"
        ) from None
    return validate_manifest(manifest, source=f"{url}/{MANIFEST_NAME}")


def _not_found_message(fs: fsspec.AbstractFileSystem, root: str) -> str:
    url = url_of(fs, root)
    parent = root.rstrip("/").rsplit("/", 1)[0]
    if fs.isfile(root):
        return f"no handoff at {url!r}: that is a file; pass the folder that holds it, {url_of(fs, parent)!r}"
    model_files = sorted(n for n in list_files(fs, root) if n == INDEX_NAME or is_shard_name(n))
    if model_files:
        return (
            f"no committed handoff at {url!r}: it holds {model_files[:3]} but no {MANIFEST_NAME}, so a write was "
            "interrupted before its commit or another tool wrote these files; save the handoff again"
        )
    if parent and parent != root and fs.isfile(join(parent, MANIFEST_NAME)):
        return (
            f"no handoff at {url!r}; it looks like a sub-folder of the handoff {url_of(fs, parent)!r}: pass its parent"
        )
    children = [
        d for d in sorted(list_files(fs, root, kind="directory"))[:50] if fs.isfile(join(join(root, d), MANIFEST_NAME))
    ]
    if children:
        return f"no handoff at {url!r}, but its sub-folders {children[:5]} hold handoffs: pass one of them"
    return f"no handoff at {url!r}: there is no {MANIFEST_NAME}. Is this the right folder?"


def _missing_message(url: str, file_name: str) -> str:
    return f"{url!r}: shard {file_name!r} named by the manifest is missing; the handoff is incomplete, write it again"


def _check_bytes(url: str, file_name: str, rec: Mapping[str, Any], size: int, digest: str | None) -> None:
    if size != rec["size"]:
        hint = " (truncated?)" if size < rec["size"] else ""
        raise HandoffCorruptError(
            f"{url!r}: shard {file_name!r} is {size} bytes, the manifest says {rec['size']}{hint}; "
            "the file was changed after it was written, write the handoff again"
        )
    if digest is not None and digest != rec["sha256"]:
        raise HandoffCorruptError(
            f"{url!r}: shard {file_name!r} has sha256 {digest}, the manifest says {rec['sha256']}; "
            "its bytes were changed after it was written, write the handoff again"
        )


def _check_contents(
    url: str,
    file_name: str,
    expected: list[str],
    found: Mapping[str, tuple[str, list[int]]],
    described: Mapping[str, Mapping[str, Any]],
) -> None:
    """The tensors a shard holds must be exactly those the weight map puts there, with the recorded dtype/shape."""
    if set(found) != set(expected):
        extra, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
        raise HandoffCorruptError(
            f"{url!r}: shard {file_name!r} disagrees with the manifest's weight_map: it holds {extra[:5]} that the map "
            f"puts elsewhere and lacks {missing[:5]} that the map puts there; write the handoff again"
        )
    for name in expected:
        dtype, shape = found[name]
        want = described[name]
        if dtype != want["dtype"] or list(shape) != want["shape"]:
            raise HandoffCorruptError(
                f"{url!r}: shard {file_name!r} holds {name!r} as {dtype}{list(shape)}, the manifest says "
                f"{want['dtype']}{want['shape']}; write the handoff again"
            )


def _check_index(fs: fsspec.AbstractFileSystem, root: str, manifest: Mapping[str, Any]) -> None:
    """Hugging Face loaders read the index, not the manifest: it must say the same."""
    where = f"{url_of(fs, root)}/{INDEX_NAME}"
    try:
        index = json.loads(fs.cat_file(join(root, INDEX_NAME)))
        weight_map, total_size = index["weight_map"], index["metadata"]["total_size"]
    except FileNotFoundError:
        raise HandoffCorruptError(
            f"{where} is missing; Hugging Face loaders need it, write the handoff again"
        ) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise HandoffCorruptError(f"{where} is not a Hugging Face index ({exc!r}); write the handoff again") from None
    for name in sorted(set(weight_map) | set(manifest["weight_map"])):
        if weight_map.get(name) != manifest["weight_map"].get(name):
            raise HandoffCorruptError(
                f"{where} puts {name!r} in shard {weight_map.get(name)!r}, the manifest in "
                f"{manifest['weight_map'].get(name)!r}; a write was interrupted or the file was edited, "
                "write the handoff again"
            )
    if total_size != manifest["total_size"]:
        raise HandoffCorruptError(
            f"{where} says total_size {total_size}, the manifest {manifest['total_size']}; write the handoff again"
        )


def _hash_file(fs: fsspec.AbstractFileSystem, path: str, size: int) -> tuple[str, bytes]:
    """sha256 of a file read in chunks, and its safetensors header bytes (parse them only once the hash matches)."""
    digest = hashlib.sha256()
    header = b""
    with fs.open(path, "rb") as f:
        head = f.read(8)
        digest.update(head)
        if len(head) == 8 and (n := int.from_bytes(head, "little")) <= min(size - 8, _MAX_HEADER):
            header = f.read(n)
            digest.update(header)
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest(), header


def _load(
    fs: fsspec.AbstractFileSystem, root: str, manifest: Mapping[str, Any], device: torch.device
) -> dict[str, torch.Tensor]:
    url = url_of(fs, root)
    by_shard = shard_names(manifest["weight_map"], list(manifest["shards"]))
    stored: dict[str, torch.Tensor] = {}
    for file_name, rec in manifest["shards"].items():
        try:
            data = fs.cat_file(join(root, file_name))
        except FileNotFoundError:
            raise _ShardVanished(_missing_message(url, file_name)) from None
        _check_bytes(url, file_name, rec, len(data), hashlib.sha256(data).hexdigest())
        try:
            tensors = safetensors.torch.load(data)
        except Exception as exc:  # the hash matched, so only a forged manifest gets here
            raise HandoffCorruptError(f"{url!r}: shard {file_name!r} is not a safetensors file ({exc})") from None
        del data
        found = {name: (_dtype_name(t.dtype), list(t.shape)) for name, t in tensors.items()}
        _check_contents(url, file_name, by_shard[file_name], found, manifest["tensors"])
        for name, tensor in tensors.items():
            stored[name] = tensor if device.type == "cpu" else tensor.to(device)
    aliases = manifest["aliases"]
    return {name: stored[aliases.get(name, name)] for name in manifest["tensors"]}


def _remove_stale(fs: fsspec.AbstractFileSystem, root: str, *, keep: set[str]) -> None:
    for name in list_files(fs, root):
        if (is_shard_name(name) and name not in keep) or is_temp_name(name):
            _remove(fs, join(root, name))


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Best effort: the handoff is committed (or never was); a file left over is cleaned by the next save."""
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("stagesafe: could not delete stale file %s (%s); the next save retries", basename(path), exc)
