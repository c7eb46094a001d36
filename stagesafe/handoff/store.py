"""Handoff storage: a state dict as safetensors shards + Hugging Face index + manifest, on any fsspec URL.

The one writer and reader of the format, used by the strategy, the CLI and the public functions alike.
Writing is split into steps, :func:`plan_handoff`, :func:`write_shard`, :func:`commit`, so that ranks can each
write their own shards and one rank commits; :func:`save_state_dict` composes them.

Commit protocol: shards are written under names the committed handoff does not use, then the index, then the
manifest ``stagesafe.json``, whose presence and content define the handoff; only after it, the previous
generation's files are deleted. A reader sees the old handoff or the new one, never a mix.

Transfers go straight to the store. Shards are written and read ``workers`` at a time (default: 4 on object
stores and other remote filesystems, 1 on a local disk), so about ``workers`` shards are in memory at once
besides the state dict itself. Every storage operation is retried on transient errors (:mod:`stagesafe.handoff.retry`);
after the last try, or on a refusal such as a missing bucket or denied access, a ``StorageTransferError`` names
the file and the URL.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import importlib.metadata
import json
import logging
import math
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any, TypeVar

import fsspec
import safetensors


from stagesafe.handoff import codec
from stagesafe.handoff import digest as _digest
from stagesafe.handoff.codec import encode_header as _safetensors_header
from stagesafe.handoff import local_shards as _local_shards
from stagesafe.handoff.fs import basename, bucket_of, fsync_dir, is_local, join, list_files, resolve, url_of, write_atomic
from stagesafe.handoff.manifest import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    MANIFEST_NAME,
    SAFETENSORS_DTYPES,
    build_index,
    build_manifest,
    check_metadata,
    digest_of,
    is_shard_name,
    is_temp_name,
    parse_size,
    plan_shards,
    shard_digest,
    shard_file_names,
    shard_names,
    temp_name,
    validate_manifest,
)
from stagesafe.handoff.retry import RetryPolicy, TransferAbandoned, call_with_retries
from stagesafe.handoff.safe_files import open_in, read_in, size_of
from stagesafe.handoff.workers import Workers
from stagesafe.progress import bytes_bar
from stagesafe.errors import (
    HandoffCorruptError,
    HandoffExistsError,
    HandoffNotFoundError,
    InvalidArgumentError,
    StorageTransferError,
    clip,
    shown,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "HandoffPlan",
    "HandoffReader",
    "Pieces",
    "save_streamed",
    "RetryPolicy",
    "ShardRecord",
    "Commit",
    "commit",
    "check_present",
    "commit_handoff",
    "delete_shards",
    "live_files",
    "refuse_existing_handoff",
    "load_state_dict",
    "plan_handoff",
    "plan_specs",
    "read_manifest",
    "remove_replaced",
    "remove_stale",
    "save_state_dict",
    "verify",
    "write_shard",
]

log = logging.getLogger(__name__)

_SUPPORTED_DTYPES = frozenset(SAFETENSORS_DTYPES.values())
_WRITE_CHUNK = 128 * 1024 * 1024  # large: each piece costs the writer the GIL a few times, under a busy trainer
_MAX_JSON = 256 * 1024 * 1024  # a manifest or index larger than this is refused unread (100k tensors: ~30 MB)
_LOCAL_WORKERS = 4  # on a local disk, at most the CPU count
_REMOTE_WORKERS = 4  # default shards in flight on a remote filesystem
_REMOVERS = 8  # stale files deleted at once
_UNCHANGED = "; nothing was committed: the handoff there before, if any, is unchanged"
_PROGRESS_FROM = 1_000_000_000  # bytes from which a load shows a bar on a terminal unless told
_READ_ROUNDS = 3  # reads started over because a writer replaced the handoff meanwhile
_INDEX_ROUNDS = 5  # looks at the index after a commit; each more is needed only while other writers commit
ORPHAN_AGE = 6 * 3600.0  # seconds: uncommitted shards and temporary files older than this are leftovers
T = TypeVar("T")


@dataclass(frozen=True)
class ShardRecord:
    """What :func:`commit` needs to know of a written shard: its ``digest`` (the name, e.g. ``xxh3-128-tree``),
    the ``hexdigest`` of its bytes, and its ``size``. Plain data, so ranks can gather it."""

    digest: str
    hexdigest: str
    size: int


@dataclass(frozen=True)
class Pieces:
    """A tensor given as the consecutive pieces of its flattened values (views of mapped files, or pieces read
    one at a time as ``parts`` is iterated, which it is once), so that :func:`write_shard` writes them as they
    are instead of joining them into a new tensor first.

    ``done(piece)`` is called once a piece's bytes are in the file (a reader can give its pages back). A piece
    may be the bytes of its values instead (``bytes``, ``bytearray``, ``memoryview``), with ``dtype`` a name
    (``"float32"``): a reader of files writes them without torch."""

    dtype: torch.dtype | str
    shape: tuple[int, ...]
    parts: Iterable[torch.Tensor | bytes | bytearray | memoryview]
    done: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class HandoffPlan:
    """Which tensor goes to which shard file, decided before anything is written."""

    shards: dict[str, list[str]]  # shard file -> names stored in it, in state-dict order
    weight_map: dict[str, str]  # stored name -> shard file (Hugging Face's index)
    tensors: dict[str, dict[str, Any]]  # every name, aliases too, in state-dict order -> {"dtype", "shape"}
    aliases: dict[str, str]  # tied name -> the name it is stored under
    total_size: int  # bytes of tensor data stored
    state_dict: Mapping[str, torch.Tensor] = field(repr=False, compare=False)

    def shard_nbytes(self, file_name: str) -> int:
        """Bytes of tensor data stored in ``file_name`` (known from the plan, before anything is written)."""
        return sum(_nbytes(self.tensors[name]) for name in self.shards[file_name])

    def shard_tensors(self, file_name: str) -> dict[str, torch.Tensor]:
        """The tensors :func:`write_shard` writes into ``file_name``."""
        return {name: self.state_dict[name] for name in self.shards[file_name]}


def plan_handoff(
    state_dict: Mapping[str, torch.Tensor],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    taken: Iterable[str] = (),
    tag: str | None = None,
) -> HandoffPlan:
    """Plan the shards of ``state_dict``, under file names of this commit's own (``tag``, or a random one that
    avoids the names in ``taken``).

    Names that are the very same tensor view (tied weights) are stored once, under the first name; the others
    become aliases. ``tag`` fixes the names' tag, so that several ranks plan alike.
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


def plan_specs(
    specs: Mapping[str, Mapping[str, Any]],
    aliases: Mapping[str, str],
    *,
    max_shard_size: int | str,
    tag: str | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> HandoffPlan:
    """The plan :func:`plan_handoff` makes, for tensors known only by ``specs`` (name -> ``{"dtype",
    "shape"}``, in state-dict order) and their tied-name ``aliases``: the same shards for the same specs."""
    limit = parse_size(max_shard_size)
    entries = [(name, _nbytes(spec)) for name, spec in specs.items() if name not in aliases]
    groups = plan_shards(entries, limit)
    shards = dict(zip(shard_file_names(len(groups), tag=tag), groups, strict=True))
    return HandoffPlan(
        shards=shards,
        weight_map={name: file for file, names in shards.items() for name in names},
        tensors={name: {"dtype": spec["dtype"], "shape": list(spec["shape"])} for name, spec in specs.items()},
        aliases=dict(aliases),
        total_size=sum(size for _, size in entries),
        state_dict=state_dict if state_dict is not None else {},
    )


def write_shard(
    fs: fsspec.AbstractFileSystem,
    root: str,
    file_name: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    specs: Mapping[str, Mapping[str, Any]] | None = None,
    retry: RetryPolicy | None = None,
    digest: str = _digest.DEFAULT,
) -> ShardRecord:
    """Write one shard file under ``root``, atomically, and return its digest and size for the manifest.

    The bytes go straight from the tensors to the file, hashed on the way with ``digest`` (one of
    :data:`stagesafe.handoff.digest.NAMES`): no serialized copy of the shard.
    Tensors are moved to the CPU and made contiguous; tensors whose bytes overlap (views of one another) are
    written as independent copies, which safetensors requires. With ``specs`` (name -> ``{"dtype", "shape"}``,
    as in ``HandoffPlan.tensors``) ``tensors`` may be a lazy mapping: each tensor is read only when its bytes
    are due and dropped after, so memory holds one tensor; a value may be :class:`Pieces`, written piece by
    piece without joining them. The write (one PUT or multipart upload on an object
    store) is tried again on transient errors as ``retry`` says.
    """
    return _write_shard(
        fs, root, file_name, tensors, specs=specs, retry=_check_retry(retry), stop=None, digest=_digest.check_name(digest)
    )


def _write_shard(
    fs: fsspec.AbstractFileSystem,
    root: str,
    file_name: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    specs: Mapping[str, Mapping[str, Any]] | None = None,
    retry: RetryPolicy,
    stop: threading.Event | None,
    digest: str = _digest.DEFAULT,
) -> ShardRecord:
    if not is_shard_name(file_name):
        raise InvalidArgumentError(
            f"file_name={file_name!r} is not a shard name of the format; take it from a HandoffPlan"
        )
    if specs is None:
        tensors = _prepare(tensors)
        specs = {name: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)} for name, t in tensors.items()}
    header, size = _safetensors_header(specs)
    digests: list[str] = []

    def stream() -> Iterator[bytes | memoryview]:
        """The shard's bytes straight from the tensors (no serialized copy), hashed on the way out by a thread
        of its own (and the pool it spreads a chunk over), so that hashing a chunk overlaps writing it and
        making the next; a lazy mapping is read one tensor at a time."""
        with _digest.Pipeline(digest) as hashing:
            for chunk in _safetensors_chunks(header, specs, tensors):
                hashing.add(chunk)  # in order, and at most one chunk ahead of the file
                yield chunk
            digests.append(hashing.hexdigest())

    def attempt() -> None:
        chunks = stream()
        try:
            write_atomic(fs, path, chunks)
        finally:
            chunks.close()  # a write that stopped early: the hashing thread ends now, not when collected

    path = join(root, file_name)
    _transfer(
        attempt,
        what=f"write shard {file_name!r} to {url_of(fs, root)!r}",
        retry=retry,
        stop=stop,
        hint=_UNCHANGED,
        writing=True,
    )
    if is_local(fs):
        _local_shards.remember(path, digest, digests[-1])  # a load in this process need not hash it again
    return ShardRecord(digest=digest, hexdigest=digests[-1], size=size)


@dataclass(frozen=True)
class Commit:
    """A committed handoff: its manifest, and the shard files of the handoff it replaced (now unused)."""

    manifest: dict[str, Any]
    replaced: frozenset[str]


def commit(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    shard_records: Mapping[str, ShardRecord],
    *,
    metadata: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    remove_stale_files: bool = True,
) -> dict[str, Any]:
    """Publish a handoff whose shards are all written; return its manifest. See :func:`commit_handoff`.

    ``remove_stale_files=False`` keeps the replaced handoff's files, for a caller that deletes them later
    with :func:`remove_replaced` (it then calls :func:`commit_handoff` to learn which they are).
    """
    done = commit_handoff(fs, root, plan, shard_records, metadata=metadata, retry=retry)
    if remove_stale_files:
        remove_replaced(fs, root, done)
    return done.manifest


def commit_handoff(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    shard_records: Mapping[str, ShardRecord],
    *,
    metadata: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> Commit:
    """Publish a handoff whose shards are all written: the index, then the manifest (the commit), then the
    index again if another writer's commit got in between, so that the two always end up agreeing.

    Deletes nothing: the files of the handoff it replaced are in the returned :class:`Commit`, for
    :func:`remove_replaced`. If writing the index or the manifest fails, the new shards stay where they are
    (the manifest may have reached the store); a later save deletes them once they are old.
    """
    retry = _check_retry(retry)
    url = url_of(fs, root)
    unwritten = [f for f in plan.shards if f not in shard_records]
    unplanned = [f for f in shard_records if f not in plan.shards]
    if unwritten or unplanned:
        raise InvalidArgumentError(
            f"cannot commit {url!r}: planned shards not written {unwritten[:3]}, written shards not planned "
            f"{unplanned[:3]}; write every shard of the plan with write_shard, then commit"
        )
    digests = {shard_records[f].digest for f in plan.shards}
    if len(digests) > 1:
        raise InvalidArgumentError(
            f"cannot commit {url!r}: its shards were hashed with different digests {sorted(digests)}; a manifest "
            "records one, so write every shard of the plan with the same digest"
        )
    manifest = build_manifest(
        digest=digests.pop() if digests else _digest.DEFAULT,
        shards={f: {"hexdigest": shard_records[f].hexdigest, "size": shard_records[f].size} for f in plan.shards},
        weight_map=plan.weight_map,
        tensors=plan.tensors,
        aliases=plan.aliases,
        total_size=plan.total_size,
        metadata=metadata,
        versions=_versions(),
        created=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
    )
    fsync_dir(fs, root)  # the shards' renames are durable before the manifest can name them
    _write_index(fs, root, manifest, retry)
    replaced = _committed_shards(fs, root, retry)
    text = (json.dumps(manifest, indent=2) + "\n").encode()
    _transfer(
        lambda: write_atomic(fs, join(root, MANIFEST_NAME), text),
        what=f"commit {url!r} (write {MANIFEST_NAME})",
        retry=retry,
        hint="; the handoff there is the previous one or, if the last try reached the store, the new one: "
        "read_manifest says which",
        writing=True,
    )
    fsync_dir(fs, root)
    try:
        _index_follows_the_manifest(fs, root, retry)
    except Exception as exc:  # noqa: BLE001 - committed: a stale index is repaired by the next save
        log.warning("stagesafe: committed %s, but could not check its %s (%s)", url, INDEX_NAME, exc)
    return Commit(manifest=manifest, replaced=frozenset(replaced - set(manifest["shards"])))


def remove_replaced(fs: fsspec.AbstractFileSystem, root: str, done: Commit) -> None:
    """After a commit: delete the shards of the handoff it replaced, and the files killed or failed writers
    left behind once they are older than :data:`ORPHAN_AGE` seconds (younger ones may belong to another
    writer's commit in progress). Best effort: a failure is logged, never raised, since the handoff is
    committed."""
    try:
        _remove_files(fs, root, done.replaced)
        _remove_orphans(fs, root)
    except Exception as exc:  # noqa: BLE001 - any storage client's error
        log.warning("stagesafe: could not delete stale files under %s (%s); a later save retries", url_of(fs, root), exc)


def remove_stale(uri: str, *, storage_options: dict[str, Any] | None = None, older_than: float | None = None) -> None:
    """Delete what writers left behind at ``uri`` and no committed handoff uses: shards of interrupted or
    failed saves and temporary files, once older than ``older_than`` seconds (default :data:`ORPHAN_AGE`).
    Best effort: a failure is logged, never raised."""
    try:
        fs, root = resolve(uri, storage_options)
        _remove_orphans(fs, root, older_than=ORPHAN_AGE if older_than is None else older_than)
    except Exception as exc:  # noqa: BLE001 - any storage client's error
        log.warning("stagesafe: could not delete stale files under %s (%s); a later save retries", uri, exc)


def live_files(fs: fsspec.AbstractFileSystem, root: str, *, retry: RetryPolicy | None = None) -> set[str]:
    """Files the committed handoff at ``root`` uses (none if there is none, or it cannot be read)."""
    return _committed_shards(fs, root, _check_retry(retry))


def refuse_existing_handoff(fs: fsspec.AbstractFileSystem, root: str, *, retry: RetryPolicy | None = None) -> None:
    """What ``overwrite=False`` means everywhere: raise :class:`HandoffExistsError` if ``root`` holds a handoff
    or any of a handoff's files (shards, index); other files are no handoff's and are left alone."""
    names = _transfer(lambda: list_files(fs, root), what=f"list {url_of(fs, root)!r}", retry=_check_retry(retry))
    present = [n for n in names if n in (MANIFEST_NAME, INDEX_NAME) or is_shard_name(n)]
    if present:
        what = "a handoff" if MANIFEST_NAME in present else f"model files {sorted(present)[:3]}"
        raise HandoffExistsError(
            f"{url_of(fs, root)!r} already holds {what}; pass overwrite=True (CLI: --overwrite) to replace it "
            "atomically, or choose another folder"
        )


def save_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    uri: str,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    retry: RetryPolicy | None = None,
    digest: str = _digest.DEFAULT,
) -> dict[str, Any]:
    """Save ``state_dict`` as a handoff at ``uri``, replacing the one there atomically; return the manifest.

    ``metadata`` (JSON values) is stored in the manifest. A handoff already at ``uri`` is an error unless
    ``overwrite=True``, which replaces it atomically (:func:`refuse_existing_handoff` says what counts).
    ``digest`` is the hash recorded for every shard (:data:`stagesafe.handoff.digest.NAMES`; ``"sha256"`` writes
    a handoff that stagesafe versions before the digest was chosen can read too).
    ``workers`` shards are built and uploaded at a time (default: 4 on a remote filesystem, 1 on a local disk),
    so about that many shards' bytes are in memory at once. Every storage operation is tried again on transient
    errors as ``retry`` says (default :class:`RetryPolicy`); if one still fails, ``StorageTransferError`` names
    it, the shards this call wrote are deleted and the handoff committed before is unchanged. Two processes
    saving to one ``uri`` at once never mix their files: the last commit wins whole, and neither deletes the
    other's shards.
    """
    fs, root = resolve(uri, storage_options)
    metadata = check_metadata(metadata)  # before anything is written
    workers = _check_workers(workers, fs)
    retry = _check_retry(retry)
    digest = _digest.check_name(digest)
    if not overwrite:
        refuse_existing_handoff(fs, root, retry=retry)
    plan = plan_handoff(state_dict, max_shard_size=max_shard_size, taken=live_files(fs, root, retry=retry))
    records = _write_shards(fs, root, plan, workers=workers, retry=retry, digest=digest)
    return commit(fs, root, plan, records, metadata=metadata, retry=retry)


def save_streamed(
    specs: Mapping[str, Mapping[str, Any]],
    aliases: Mapping[str, str],
    tensors: Mapping[str, torch.Tensor],
    uri: str,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Save a state dict known only by ``specs`` (name -> ``{"dtype", "shape"}``), pulling each tensor from
    ``tensors`` exactly once, in ``specs`` order (aliases skipped), as its bytes are due.

    For sources that produce tensors on demand and cannot repeat themselves (a collective gather per tensor):
    shards are written one after the other, and not retried, since retrying would ask for a tensor twice.
    Memory holds one tensor. The commit protocol is :func:`save_state_dict`'s.
    """
    fs, root = resolve(uri, storage_options)
    metadata = check_metadata(metadata)
    once = RetryPolicy(attempts=1)
    plan = plan_specs(specs, aliases, max_shard_size=max_shard_size, state_dict=tensors)
    records = {}
    try:
        for file_name, names in plan.shards.items():
            shard_specs = {name: plan.tensors[name] for name in names}
            records[file_name] = _write_shard(fs, root, file_name, tensors, specs=shard_specs, retry=once, stop=None)
    except BaseException:
        for file_name in records:
            _remove(fs, join(root, file_name))
        raise
    return commit(fs, root, plan, records, metadata=metadata, retry=once)


def check_writable(
    uri: str, *, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
) -> None:
    """Fail now rather than after a stage: write and delete a small temporary file under ``uri`` (a path that
    cannot be created, missing credentials or permissions, no such bucket)."""
    fs, root = resolve(uri, storage_options)
    name = temp_name(MANIFEST_NAME)  # a name the store's own cleanup removes, should this be left
    write_probe(fs, root, name, b"{}", retry=retry)
    _remove(fs, join(root, name))


def write_probe(
    fs: fsspec.AbstractFileSystem, root: str, name: str, data: bytes, *, retry: RetryPolicy | None = None
) -> None:
    """Write a small file ``name`` under ``root``, with the store's errors for a folder that cannot be written."""
    _transfer(
        lambda: write_atomic(fs, join(root, name), data),
        what=f"write to {url_of(fs, root)!r}",
        retry=_check_retry(retry),
        hint=_UNCHANGED,
        writing=True,
    )


def read_small(fs: fsspec.AbstractFileSystem, path: str, *, limit: int = 4096) -> bytes | None:
    """The bytes of a small file, or None when it is missing, larger than ``limit`` or unreadable."""
    try:
        with fs.open(path, "rb") as f:
            data = f.read(limit + 1)
    except Exception:  # noqa: BLE001 - any storage client's error means: not seen
        return None
    return data if len(data) <= limit else None


def remove_file(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete one file, best effort (a leftover is deleted by a later save once it is old)."""
    _remove(fs, path)


def check_present(uri: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Raise ``HandoffNotFoundError`` or ``HandoffCorruptError`` unless the committed handoff at ``uri`` is
    there whole: its manifest valid, every shard it names present with the size it records. Cheap (no shard
    is read); returns the manifest."""
    fs, root = resolve(uri, storage_options)
    manifest = _fetch_manifest(fs, root, RetryPolicy(attempts=1))
    fs.invalidate_cache(root)
    sizes = {basename(e["name"]): e.get("size") for e in fs.ls(root, detail=True) if e.get("type") == "file"}
    url = url_of(fs, root)
    for file_name, record in manifest["shards"].items():
        if file_name not in sizes:
            raise HandoffCorruptError(_missing_message(url, file_name))
        _check_bytes(url, manifest, file_name, sizes[file_name], None)
    return manifest


def read_manifest(
    uri: str, *, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
) -> dict[str, Any]:
    """The manifest of the committed handoff at ``uri`` (validated, shards not checked)."""
    fs, root = resolve(uri, storage_options)
    return _fetch_manifest(fs, root, _check_retry(retry))


def load_state_dict(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
    workers: int | None = None,
    retry: RetryPolicy | None = None,
    verify: bool = True,
    progress: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Load the committed handoff at ``uri``, every shard checked against the manifest before it is parsed.

    Reads ``workers`` shards at a time (default: 4 on a remote filesystem, up to 4 on a local disk), each tried
    again on transient errors as ``retry`` says. A local shard is mapped, as ``load_file`` maps it, and hashed
    through the mapping on every core; one this process already hashed (it wrote or loaded it), unchanged since,
    is mapped without hashing it again. A remote shard is hashed chunk by chunk while the next chunk arrives.
    ``verify=False`` skips the digest of every shard (sizes and headers are still checked). Tensors are views
    of their shard's buffer; tied names come back as the same tensor object, in the order they were saved.
    ``progress``: a bar on stderr, shard by shard (default: on a terminal, for a handoff of a gigabyte or more).
    """
    fs, root = resolve(uri, storage_options)
    workers = _check_workers(workers, fs)
    retry = _check_retry(retry)
    import torch

    device = torch.device(device)
    if not isinstance(verify, bool):
        raise InvalidArgumentError(f"verify={verify!r} must be True or False")
    manifest = _fetch_manifest(fs, root, retry)
    with _progress(progress, manifest, f"loading {uri}", least=_PROGRESS_FROM) as on_shard:
        return _while_unchanged(
            fs, root, manifest, retry,
            lambda m: _load(fs, root, m, device, workers=workers, retry=retry, verify=verify, on_shard=on_shard),
        )


@contextlib.contextmanager
def _progress(
    progress: bool | None, manifest: Mapping[str, Any], what: str, *, least: int = 0
) -> Iterator[Callable[[int], None] | None]:
    """A bar counting the handoff's shard bytes (:func:`stagesafe.progress.bytes_bar`), as the callable that
    adds to it, or None; ``least``: below that many bytes there is none unless asked (it would only flash)."""
    total = sum(record["size"] for record in manifest["shards"].values())
    bar = bytes_bar(False if progress is None and total < least else progress, total, what)
    try:
        yield bar.update if bar is not None else None
    finally:
        if bar is not None:
            bar.close()


def _while_unchanged(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: dict[str, Any],
    retry: RetryPolicy,
    read: Callable[[dict[str, Any]], T],
) -> T:
    """``read(manifest)``, started over from the new manifest when a writer replaced the handoff meanwhile
    (and deleted the shards being read): only a handoff that stays committed while it is read is damaged."""
    for _ in range(_READ_ROUNDS):
        try:
            return read(manifest)
        except (_ShardVanished, HandoffCorruptError) as exc:
            newer = _fetch_manifest(fs, root, retry)
            if newer == manifest:
                if isinstance(exc, _ShardVanished):
                    raise HandoffCorruptError(str(exc)) from None
                raise
            manifest = newer
    raise HandoffCorruptError(
        f"{url_of(fs, root)!r} was replaced {_READ_ROUNDS} times while being read; read it again later"
    )


def verify(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
    retry: RetryPolicy | None = None,
    fix_index: bool = False,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Re-hash every shard of the handoff at ``uri`` against its manifest, check their contents and the index.

    Streams each shard, ``workers`` at a time (default: 4 on a remote filesystem, 1 on a local disk), so memory
    stays bounded. Raises ``HandoffCorruptError`` naming the shard and what differs; returns the manifest.
    ``fix_index``: an index that differs from the manifest is rewritten from it (once the shards verified)
    instead of being an error. ``progress``: a bar on stderr (default: on a terminal).
    """
    fs, root = resolve(uri, storage_options)
    workers = _check_workers(workers, fs)
    retry = _check_retry(retry)
    if not isinstance(fix_index, bool):
        raise InvalidArgumentError(f"fix_index={fix_index!r} must be True or False")
    fs.invalidate_cache(root)  # sizes must come from the store, not from a listing cached before a write
    manifest = _fetch_manifest(fs, root, retry)
    with _progress(progress, manifest, f"verifying {uri}") as on_read:
        return _while_unchanged(
            fs, root, manifest, retry,
            lambda m: _verify(fs, root, m, workers=workers, retry=retry, fix_index=fix_index, on_read=on_read),
        )


def _verify(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: dict[str, Any],
    *,
    workers: int,
    retry: RetryPolicy,
    fix_index: bool,
    on_read: Callable[[int], None] | None,
) -> dict[str, Any]:
    def check(file_name: str, stop: threading.Event) -> None:
        _verify_shard(fs, root, manifest, file_name, retry=retry, stop=stop, on_read=on_read)

    # The index first, right after the manifest: a writer replacing the handoff while the shards are hashed
    # rewrites the index too, and only one read just after the manifest's can be expected to match it.
    stale = _index_difference(fs, root, manifest, retry)
    _each(list(manifest["shards"]), check, workers)
    if stale is not None and fix_index:
        _write_index(fs, root, manifest, retry)
        log.warning("stagesafe: %s; it was rewritten from the manifest", stale)
    elif stale is not None:
        raise HandoffCorruptError(
            f"{stale}. Loaders that follow the index (transformers, safetensors' sharded loaders) would read "
            "other tensors than the handoff holds; its shards verified against the manifest. Rewrite the index "
            f"from the manifest: stagesafe verify --fix-index {url_of(fs, root)} (or stagesafe.verify(url, "
            "fix_index=True)), or save the handoff again"
        )
    return manifest


# -- internals --------------------------------------------------------------------------------------------------


class _ShardVanished(Exception):
    """A shard named by the manifest is not there (replaced by a newer handoff, or lost)."""


def _check_workers(workers: Any, fs: fsspec.AbstractFileSystem) -> int:
    if workers is None:  # local disks too: shards hash at once, outside the GIL
        return min(_LOCAL_WORKERS, os.cpu_count() or 1) if is_local(fs) else _REMOTE_WORKERS
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgumentError(f"workers={workers!r} must be a positive int: the shards transferred at once")
    return workers


def _check_retry(retry: Any) -> RetryPolicy:
    if retry is None:
        return RetryPolicy()
    if not isinstance(retry, RetryPolicy):
        raise InvalidArgumentError(
            f"retry={retry!r} must be a stagesafe.handoff.store.RetryPolicy, e.g. RetryPolicy(attempts=8, initial_delay=2)"
        )
    return retry


def _transfer(
    fn: Callable[[], T],
    *,
    what: str,
    retry: RetryPolicy,
    stop: threading.Event | None = None,
    hint: str = "",
    writing: bool = False,
) -> T:
    """``fn()``, a storage operation, tried again on transient errors; a refusal by the store named as ``what``.

    ``FileNotFoundError`` propagates from reads (callers know what a missing file means there); from a write it
    means the bucket is missing.
    """
    try:
        return call_with_retries(fn, policy=retry, what=what, hint=hint, stop=stop)
    except PermissionError as exc:
        raise StorageTransferError(
            f"could not {what}: access denied ({exc}); check the credentials in storage_options (key/secret, "
            f"profile, token) and that they may {'write' if writing else 'read'} there{hint}"
        ) from exc
    except FileNotFoundError as exc:
        if not writing:
            raise
        raise StorageTransferError(
            f"could not {what}: the bucket or folder it goes into does not exist ({exc}); create it first, or "
            f"correct the URL{hint}"
        ) from exc
    except StorageTransferError:
        raise
    except OSError as exc:  # disk full, file too large, read-only file system, a file where a folder should be
        if not writing:
            raise
        raise StorageTransferError(f"could not {what}: {exc}{hint}") from exc


def _each(items: Sequence[str], fn: Callable[[str, threading.Event], T], workers: int) -> dict[str, T]:
    """``fn(item, stop)`` for every item, ``workers`` at a time; return the results in the items' order.

    Only ``workers`` calls run at once, so memory is bounded by what each one holds. The first failure sets
    ``stop`` (so that the others stop retrying) and cancels the calls not started; once the running ones are done,
    the failure of the earliest item is raised, as a loop over the items would have raised it.
    """
    stop = threading.Event()
    if workers == 1 or len(items) <= 1:
        return {item: fn(item, stop) for item in items}
    pool = Workers(min(workers, len(items)), name="stagesafe-transfer")
    try:
        futures = [pool.submit(fn, item, stop) for item in items]
        for future in concurrent.futures.as_completed(futures):
            if future.exception() is not None:
                break
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
    failures = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    if failures:  # the items start in order, so every item before a failed one has run
        raise next((e for e in failures if not isinstance(e, TransferAbandoned)), failures[0])
    return {item: future.result() for item, future in zip(items, futures)}


def write_shards(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    files: Iterable[str],
    *,
    workers: int | None = None,
    retry: RetryPolicy | None = None,
) -> dict[str, ShardRecord]:
    """Write the shards ``files`` of ``plan`` (a share of them: each rank of a job may write its own), ``workers``
    at a time; if one fails, delete those written and raise. :func:`commit` then publishes them all."""
    wanted = list(files)
    unknown = [f for f in wanted if f not in plan.shards]
    if unknown:
        raise InvalidArgumentError(f"{unknown[:3]} are not shards of the plan; take the names from plan.shards")
    return _write_shards(fs, root, plan, workers=_check_workers(workers, fs), retry=_check_retry(retry), only=wanted)


def _write_shards(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    *,
    workers: int,
    retry: RetryPolicy,
    only: list[str] | None = None,
    digest: str = _digest.DEFAULT,
) -> dict[str, ShardRecord]:
    """Write the shards of ``plan`` (or ``only`` these), ``workers`` at a time; if one fails, delete those
    written and raise."""
    files = list(plan.shards) if only is None else only
    lock = threading.Lock()
    written: dict[str, ShardRecord] = {}

    def one(file_name: str, stop: threading.Event) -> None:
        record = _write_shard(
            fs, root, file_name, plan.shard_tensors(file_name), retry=retry, stop=stop, digest=digest
        )
        with lock:
            written[file_name] = record

    try:
        _each(files, one, workers)
    except BaseException:
        # Never a live file: the plan's names avoid the committed handoff's. One try each: if the store is
        # down, the next save deletes them.
        _each(list(written), lambda name, _: _remove(fs, join(root, name)), workers)
        raise
    return {file_name: written[file_name] for file_name in files}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_entry(name: Any, tensor: Any) -> None:
    import torch

    codec.check_name(name)
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


def _nbytes(spec: Mapping[str, Any]) -> int:
    import torch

    return math.prod(spec["shape"]) * getattr(torch, spec["dtype"]).itemsize


def _safetensors_chunks(
    header: bytes, specs: Mapping[str, Mapping[str, Any]], tensors: Mapping[str, torch.Tensor | Pieces]
) -> Iterator[bytes | memoryview]:
    yield header
    for name, spec in specs.items():
        value = tensors[name]
        if isinstance(value, Pieces):
            dtype, shape, parts, done = value.dtype, value.shape, value.parts, value.done
        else:
            parts, done = (value.detach().to("cpu").contiguous(),), None
            dtype, shape = parts[0].dtype, parts[0].shape
        if _dtype_name(dtype) != spec["dtype"] or list(shape) != list(spec["shape"]):
            raise InvalidArgumentError(
                f"tensor {name!r} is {_dtype_name(dtype)}{list(shape)} but was planned as "
                f"{spec['dtype']}{list(spec['shape'])}; the state dict changed while it was being written"
            )
        for part in parts:
            data = _piece_bytes(part)
            if data is not None:
                for start in range(0, len(data), _WRITE_CHUNK):  # hashing one piece overlaps writing another
                    yield data[start : start + _WRITE_CHUNK]
                if done is not None:
                    done(part)
        del value, parts


def _piece_bytes(part: torch.Tensor | bytes | bytearray | memoryview) -> memoryview | None:
    """The bytes of a non-empty piece: bytes as they are, a tensor's values (torch is loaded if it is one)."""
    if isinstance(part, (bytes, bytearray, memoryview)):
        return memoryview(part).cast("B") if len(part) else None
    if not part.numel():
        return None
    import torch

    return memoryview(part.contiguous().reshape(-1).view(torch.uint8).numpy())


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
        "torch": sys.modules["torch"].__version__ if "torch" in sys.modules else dist("torch"),  # not imported for it
        "safetensors": safetensors.__version__,
        "fsspec": fsspec.__version__,
        "stagesafe": dist("stagesafe") or getattr(sys.modules.get("stagesafe"), "__version__", None),
    }
    for name in ("deepspeed", "lightning", "pytorch-lightning"):  # metadata only: importing them is slow
        if (version := dist(name)) is not None:
            versions[name] = version
    return versions


def _fetch_manifest(fs: fsspec.AbstractFileSystem, root: str, retry: RetryPolicy) -> dict[str, Any]:
    """The committed manifest, read with retries."""
    return _transfer(lambda: _read_manifest(fs, root), what=f"read {url_of(fs, root)}/{MANIFEST_NAME}", retry=retry)


def _read_manifest(fs: fsspec.AbstractFileSystem, root: str, *, explain: bool = True) -> dict[str, Any]:
    """The committed manifest (one try). ``explain=False``: skip looking around for a helpful not-found message."""
    url = url_of(fs, root)
    where = f"{url}/{MANIFEST_NAME}"
    try:
        raw = read_in(fs, root, MANIFEST_NAME, limit=_MAX_JSON, error=HandoffCorruptError, what=where)
    except (FileNotFoundError, NotADirectoryError):
        message = _not_found_message(fs, root) if explain else f"no handoff at {url!r}"
        raise HandoffNotFoundError(message) from None
    return validate_manifest(_json(raw, where), source=where)


def _json(raw: bytes, where: str) -> Any:
    """A JSON document the store wrote (manifest, index), or ``HandoffCorruptError`` saying why it is not one."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = clip(str(exc), 160)
    except RecursionError:
        reason = "nested too deeply"
    except ValueError as exc:  # an integer of more digits than Python converts
        reason = clip(str(exc), 160)
    raise HandoffCorruptError(
        f"{where} is not valid JSON ({reason}); it was damaged or edited, write the handoff again"
    )


def _not_found_message(fs: fsspec.AbstractFileSystem, root: str) -> str:
    url = url_of(fs, root)
    bucket = bucket_of(fs, root)
    if bucket is not None:
        try:
            missing = not fs.exists(bucket)
        except Exception:  # noqa: BLE001 - only a hint; the not-found error below says enough
            missing = False
        if missing:
            return (
                f"no handoff at {url!r}: the bucket {bucket!r} does not exist (or these credentials cannot see "
                "it); check the URL and the storage_options"
            )
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


def _check_bytes(url: str, manifest: Mapping[str, Any], file_name: str, size: int, hexdigest: str | None) -> None:
    """The shard ``file_name`` has the manifest's size and, when ``hexdigest`` is given, its digest."""
    expected = manifest["shards"][file_name]["size"]
    if size != expected:
        hint = " (truncated?)" if size < expected else ""
        raise HandoffCorruptError(
            f"{url!r}: shard {file_name!r} is {size} bytes, the manifest says {expected}{hint}; "
            "the file was changed after it was written, write the handoff again"
        )
    if hexdigest is not None and hexdigest != shard_digest(manifest, file_name):
        raise HandoffCorruptError(
            f"{url!r}: shard {file_name!r} has {digest_of(manifest)} {hexdigest}, the manifest says "
            f"{shard_digest(manifest, file_name)}; its bytes were changed after it was written, write the handoff again"
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


def _index_difference(
    fs: fsspec.AbstractFileSystem, root: str, manifest: Mapping[str, Any], retry: RetryPolicy
) -> str | None:
    """How the Hugging Face index differs from the manifest (loaders read the index, not the manifest), or
    None where they agree. A missing or malformed index says so."""
    where = f"{url_of(fs, root)}/{INDEX_NAME}"
    try:
        raw = _transfer(
            lambda: read_in(fs, root, INDEX_NAME, limit=_MAX_JSON, error=HandoffCorruptError, what=where),
            what=f"read {where}",
            retry=retry,
        )
    except FileNotFoundError:
        return f"{where} is missing"
    try:
        weight_map, total_size = _index_entries(_json(raw, where), where)
    except HandoffCorruptError as exc:
        return str(exc).removesuffix("; write the handoff again")
    if weight_map != manifest["weight_map"]:
        missing = [n for n in manifest["weight_map"] if n not in weight_map]
        extra = [n for n in weight_map if n not in manifest["weight_map"]]
        moved = [n for n in manifest["weight_map"] if n in weight_map and weight_map[n] != manifest["weight_map"][n]]
        parts = [f"{len(missing)} tensor(s) missing, e.g. {shown(missing[0])}" if missing else "",
                 f"{len(extra)} tensor(s) the manifest does not have, e.g. {shown(extra[0])}" if extra else "",
                 f"{len(moved)} tensor(s) in another shard, e.g. {shown(moved[0])} in {weight_map[moved[0]]!r}, "
                 f"the manifest's {manifest['weight_map'][moved[0]]!r}" if moved else ""]
        interrupted = _index_of_an_interrupted_save(fs, root, weight_map, where)
        return (
            f"{where} differs from the committed manifest: {'; '.join(p for p in parts if p)}"
            + (" (it is the index of a later save that was interrupted before its manifest)" if interrupted else "")
        )
    if total_size != manifest["total_size"]:
        return f"{where} says total_size {total_size}, the manifest {manifest['total_size']}"
    return None


def _index_entries(index: Any, where: str) -> tuple[dict[str, str], int]:
    """``(weight_map, total_size)`` of a Hugging Face index whose every file is a shard name of this format:
    a file in another folder (``../x``) or of another name is never opened."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    metadata = index.get("metadata") if isinstance(index, dict) else None
    total_size = metadata.get("total_size") if isinstance(metadata, dict) else None
    if not isinstance(weight_map, dict) or type(total_size) is not int:
        raise HandoffCorruptError(
            f"{where} is not a Hugging Face index ({{'metadata': {{'total_size': int}}, 'weight_map': {{...}}}}), "
            f"got {shown(index)}; write the handoff again"
        )
    for name, file in weight_map.items():
        if not isinstance(file, str) or not is_shard_name(file):
            raise HandoffCorruptError(
                f"{where} puts {shown(name)} in {shown(file)}, which is not a shard file name of this format "
                "(a path to another folder?); it was not opened. Write the handoff again"
            )
    return weight_map, total_size


def _index_of_an_interrupted_save(
    fs: fsspec.AbstractFileSystem, root: str, weight_map: Mapping[str, str], where: str
) -> bool:
    """True when every shard the index names exists and holds exactly the tensors the index puts there: the
    index of a complete set of shards whose manifest was never written (the writer died between the two).
    A shard that is not a regular file inside the folder is refused, not read."""
    by_shard: dict[str, set[str]] = {}
    for name, file_name in weight_map.items():
        by_shard.setdefault(file_name, set()).add(name)
    if not by_shard:  # names no shard at all: nothing shows it is a save's
        return False
    for file_name, names in by_shard.items():
        what = f"{where}: shard {file_name!r} it names"
        try:
            f = open_in(fs, root, file_name, error=HandoffCorruptError, what=what)
        except OSError:
            return False
        try:
            with f:
                header = _read_header(f, size_of(f), source=what)
        except (OSError, HandoffCorruptError):
            return False
        if {t.name for t in header.tensors} != names:
            return False
    return True


def _read_header(f: IO[bytes], size: int, *, source: str) -> codec.Header:
    """The checked header of the safetensors file open as ``f`` (at its start), ``size`` bytes long."""
    prefix = f.read(8)
    length = codec.header_length(prefix, size, source=source)
    return codec.parse_header(prefix + f.read(length), size, source=source)


def _hash_file(
    f: IO[bytes], size: int, source: str, digest: str, *, on_read: Callable[[int], None] | None = None
) -> tuple[str, int, codec.Header | HandoffCorruptError]:
    """The ``digest`` of the file open as ``f``, read in chunks up to one byte past ``size`` (so a file that grew
    shows), each hashed while the next is read; the number of bytes read; and its safetensors header: checked,
    or what is wrong with it (to be raised only once the hash matches, since a changed byte says more)."""
    head = f.read(8)
    try:
        head += f.read(codec.header_length(head, size, source=source))
        header: codec.Header | HandoffCorruptError = codec.parse_header(head, size, source=source)
    except HandoffCorruptError as exc:
        header = exc
    rest, hexdigest = _digest.hash_file(f, max(size + 1 - len(head), 0), digest, head=head, on_read=on_read)
    return hexdigest, len(head) + rest, header


def _verify_shard(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Mapping[str, Any],
    file_name: str,
    *,
    retry: RetryPolicy,
    stop: threading.Event | None,
    on_read: Callable[[int], None] | None = None,
) -> None:
    """Check one shard as a load would, streaming it: a regular file of the folder, of the manifest's size,
    digest, header and tensors; memory stays bounded whatever its size."""
    url = url_of(fs, root)
    source = f"{url!r}: shard {file_name!r}"

    def hashed() -> tuple[str, int, codec.Header | HandoffCorruptError]:
        with open_in(fs, root, file_name, error=HandoffCorruptError, what=source) as f:
            size = size_of(f)
            _check_bytes(url, manifest, file_name, size, None)  # before reading a byte of it
            return _hash_file(f, size, source, digest_of(manifest), on_read=on_read)

    try:
        digest, done, header = _transfer(
            hashed, what=f"read shard {file_name!r} of {url!r}", retry=retry, stop=stop
        )
    except FileNotFoundError:
        raise _ShardVanished(_missing_message(url, file_name)) from None
    _check_bytes(url, manifest, file_name, done, digest)
    if isinstance(header, HandoffCorruptError):  # the hash matched, so only a forged manifest gets here
        raise header
    found = {t.name: (t.dtype, list(t.shape)) for t in header.tensors}
    expected = shard_names(manifest["weight_map"], list(manifest["shards"]))[file_name]
    _check_contents(url, file_name, expected, found, manifest["tensors"])


def _load(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Mapping[str, Any],
    device: torch.device,
    *,
    workers: int,
    retry: RetryPolicy,
    verify: bool,
    on_shard: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    def one(file_name: str, stop: threading.Event) -> dict[str, torch.Tensor]:
        tensors = _read_shard(fs, root, manifest, file_name, device, retry=retry, stop=stop, verify=verify)
        if on_shard is not None:
            on_shard(manifest["shards"][file_name]["size"])
        return tensors

    stored: dict[str, torch.Tensor] = {}
    for tensors in _each(list(manifest["shards"]), one, workers).values():
        stored.update(tensors)
    aliases = manifest["aliases"]
    return {name: stored[aliases.get(name, name)] for name in manifest["tensors"]}


def _read_shard(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Mapping[str, Any],
    file_name: str,
    device: torch.device,
    *,
    retry: RetryPolicy,
    stop: threading.Event | None = None,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """One shard's tensors, its size and digest checked against the manifest before it is parsed (without
    ``verify``, or for a local file this process has already hashed, its size only). The file must be a regular
    file of the folder, and its size the manifest's before a byte of it is read. A local file is mapped, as
    ``load_file`` maps it, and hashed through the mapping; a remote one is read into memory, each chunk hashed
    while the next arrives."""
    url = url_of(fs, root)
    size = manifest["shards"][file_name]["size"]
    digest, expected = digest_of(manifest), shard_digest(manifest, file_name)
    source = f"{url!r}: shard {file_name!r}"
    path = join(root, file_name)

    import torch

    def read() -> tuple[torch.Tensor, str | None]:
        with open_in(fs, root, file_name, error=HandoffCorruptError, what=source) as f:
            _check_bytes(url, manifest, file_name, size_of(f), None)
            if is_local(fs) and (not verify or _local_shards.known(path, digest, expected, f=f)):
                return _local_shards.map_file(f, size), None
            if is_local(fs):
                buffer, found = _local_shards.map_hashed(f, size, digest)
                _check_bytes(url, manifest, file_name, size_of(f), None)  # not cut or grown while it was hashed
                if found == expected:
                    _local_shards.remember(path, digest, found, f=f)
                return buffer, found
            if not verify:
                data, found = bytearray(f.read(size + 1)), None
                n = len(data)
            else:
                data = bytearray(size + 1)
                n, found = _digest.read_hashed(f, data, digest)
            if not n:
                return torch.empty(0, dtype=torch.uint8), found
            return torch.frombuffer(data, dtype=torch.uint8)[:n], found

    try:
        buffer, found = _transfer(read, what=f"read shard {file_name!r} of {url!r}", retry=retry, stop=stop)
    except FileNotFoundError:
        raise _ShardVanished(_missing_message(url, file_name)) from None
    _check_bytes(url, manifest, file_name, buffer.numel(), found)
    tensors = _local_shards.tensors_in(buffer, source=source)  # the hash matched: only a forged manifest fails here
    found = {name: (_dtype_name(t.dtype), list(t.shape)) for name, t in tensors.items()}
    expected = shard_names(manifest["weight_map"], list(manifest["shards"]))[file_name]
    _check_contents(url, file_name, expected, found, manifest["tensors"])
    return {name: tensor if device.type == "cpu" else tensor.to(device) for name, tensor in tensors.items()}


class HandoffReader(Mapping):
    """A committed handoff as a read-only mapping that holds one verified shard in memory at a time.

    For callers that take tensors one by one in their own order (feeding an engine layer by layer): memory
    stays near one shard whatever the model size. Tensors are in the manifest's order; tied names alias.
    """

    def __init__(
        self, uri: str, *, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
    ) -> None:
        self._retry = _check_retry(retry)
        self._fs, self._root = resolve(uri, storage_options)
        self.manifest = _fetch_manifest(self._fs, self._root, self._retry)
        self._cached: tuple[str | None, dict[str, torch.Tensor]] = (None, {})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.manifest["tensors"]:
            raise KeyError(name)
        stored = self.manifest["aliases"].get(name, name)
        file_name = self.manifest["weight_map"][stored]
        if self._cached[0] != file_name:
            import torch

            self._cached = (None, {})  # drop the previous shard before reading the next
            try:
                tensors = _read_shard(
                    self._fs, self._root, self.manifest, file_name, torch.device("cpu"), retry=self._retry
                )
            except _ShardVanished as exc:
                raise HandoffCorruptError(f"{exc} (or a writer replaced the handoff while it was read)") from None
            self._cached = (file_name, tensors)
        return self._cached[1][stored]

    def __iter__(self) -> Iterator[str]:
        return iter(self.manifest["tensors"])

    def __len__(self) -> int:
        return len(self.manifest["tensors"])


def _write_index(fs: fsspec.AbstractFileSystem, root: str, manifest: Mapping[str, Any], retry: RetryPolicy) -> None:
    index = (json.dumps(build_index(manifest["weight_map"], manifest["total_size"]), indent=2, sort_keys=True) + "\n")
    _transfer(
        lambda: write_atomic(fs, join(root, INDEX_NAME), index.encode()),
        what=f"write {INDEX_NAME} to {url_of(fs, root)!r}",
        retry=retry,
        hint=_UNCHANGED,
        writing=True,
    )


def _committed_shards(fs: fsspec.AbstractFileSystem, root: str, retry: RetryPolicy) -> set[str]:
    """The shard files of the committed handoff at ``root``; none if there is none or it cannot be read (its
    files are then left to the age rule of :func:`_remove_orphans`)."""
    try:
        manifest = _transfer(
            lambda: _read_manifest(fs, root, explain=False), what=f"read {url_of(fs, root)}/{MANIFEST_NAME}", retry=retry
        )
    except (HandoffNotFoundError, HandoffCorruptError):
        return set()
    return set(manifest["shards"])


def _index_follows_the_manifest(fs: fsspec.AbstractFileSystem, root: str, retry: RetryPolicy) -> None:
    """Make the index describe the committed manifest, whichever writer committed last.

    Each writer writes its index before its manifest; with two writers at once, the last index written may
    belong to the commit that lost. After its own commit, a writer looks again, and rewrites the index from
    the manifest it finds until the two agree: the last writer to look always sees the last commit.
    """
    for _ in range(_INDEX_ROUNDS):
        try:
            manifest = _read_manifest(fs, root, explain=False)
        except (HandoffNotFoundError, HandoffCorruptError):
            return
        try:
            index = json.loads(fs.cat_file(join(root, INDEX_NAME)))
            if index.get("weight_map") == manifest["weight_map"]:
                return
        except (OSError, ValueError, AttributeError):
            pass  # missing or unreadable: written below
        _write_index(fs, root, manifest, retry)


def _file_age(entry: Mapping[str, Any], now: datetime) -> float | None:
    """Seconds since a listed file was last written, from whichever field the filesystem reports; None if
    it reports none (such a file is never taken for a leftover)."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        value = entry.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return now.timestamp() - float(value)
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(value, datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=timezone.utc)
            return (now - value).total_seconds()
    return None


def _remove_orphans(fs: fsspec.AbstractFileSystem, root: str, *, older_than: float | None = None) -> None:
    """Delete shard and temporary files that the committed handoff does not use and that are older than
    ``older_than`` seconds: what killed or failed writers left. Younger ones may be another writer's commit
    in progress, and are left for a later save."""
    limit = ORPHAN_AGE if older_than is None else older_than
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return
    keep = _committed_shards(fs, root, RetryPolicy(attempts=1))
    now = datetime.now(timezone.utc)
    old = []
    for entry in entries:
        name = basename(entry["name"])
        if entry.get("type") != "file" or name in keep or not (is_shard_name(name) or is_temp_name(name)):
            continue
        age = _file_age(entry, now)
        if age is not None and age >= limit:
            old.append(name)
    _remove_files(fs, root, old)


def delete_shards(fs: fsspec.AbstractFileSystem, root: str, names: Iterable[str]) -> None:
    """Delete the shard files ``names`` of a write that failed before its commit (best effort: a file left
    over is deleted by a later save once it is old)."""
    _remove_files(fs, root, names)


def _remove_files(fs: fsspec.AbstractFileSystem, root: str, names: Iterable[str]) -> None:
    """Several at once, for object stores, where each delete is a round trip (on a local disk, freeing the
    files' cached pages takes the kernel about as long either way)."""
    paths = [join(root, n) for n in names]
    if not paths:
        return
    with Workers(min(len(paths), _REMOVERS), name="stagesafe-rm") as pool:
        list(pool.map(lambda path: _remove(fs, path), paths))


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Best effort: the handoff is committed (or never was); a file left over is cleaned by the next save."""
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - any storage client's error (botocore's are not OSErrors)
        log.warning("stagesafe: could not delete stale file %s (%s); the next save retries", basename(path), exc)
