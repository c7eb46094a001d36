"""The one commit protocol of a handoff: plan -> shards -> commit, whoever writes; then the replaced files go.

``save_state_dict``, ``consolidate`` and the strategy's writer all go through :func:`write_and_commit`: this
process writes its shards of the plan; the commit follows once every shard is written: the manifest
``stagesafe.json``, whose presence and content define the handoff, then the Hugging Face index; only after both,
the replaced handoff's files are deleted (:func:`remove_replaced`). A handoff written by several ranks at once
gives it a :class:`RecordExchange`, the small transport through which each writing rank but 0 posts its shards'
records (or its failure) and rank 0 gathers them: rank 0 commits once it has heard from every writing rank, or
deletes every shard of the write and fails, leaving the committed handoff as it was. Nothing here knows how the
ranks talk: the strategy's exchange is the job's key-value store.

A reader sees the old handoff or the new one, never a mix. The index follows the commit, so that at any point a
writer may die it names the committed shards or those of the commit before, still in place: never a save that
did not commit. Two writers committing to one folder at once never mix their files: each writes shards of its
own names, the last manifest wins whole, and the index is made to follow it (:func:`commit_handoff`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

import fsspec
import safetensors

from stagesafe.errors import HandoffCorruptError, HandoffNotFoundError, InvalidArgumentError, StorageTransferError
from stagesafe.handoff import digest as _digest
from stagesafe.handoff import known_manifests
from stagesafe.handoff.cleanup import delete_shards, remove_orphans
from stagesafe.handoff.index import build_index
from stagesafe.handoff.manifest import build_manifest
from stagesafe.handoff.names import INDEX_NAME, MANIFEST_NAME
from stagesafe.handoff.optimizer_state import bound_folder, remove_state
from stagesafe.handoff.plan import HandoffPlan
from stagesafe.handoff.read import checked_manifest, committed_bytes, committed_or_none, committed_shards
from stagesafe.handoff.shards import UNCHANGED, ShardRecord, write_shards
from stagesafe.progress import bytes_bar
from stagesafe.storage.folder import Folder, check_retry
from stagesafe.storage.fs import fsync_dir, url_of
from stagesafe.storage.retry import RetryPolicy

__all__ = [
    "Commit", "RecordExchange", "commit", "commit_handoff", "index_follows_the_manifest", "remove_replaced",
    "write_and_commit", "write_and_replace", "write_index",
]

log = logging.getLogger(__name__)

_INDEX_ROUNDS = 5  # looks at the index after a commit; each more is needed only while other writers commit


@dataclass(frozen=True)
class Commit:
    """A committed handoff: its manifest, and the shard files of the handoff it replaced (now unused), and the
    optimizer state folder that handoff named and this one does not (:mod:`.optimizer_state`); ``folder``:
    where it was committed, for :func:`remove_replaced`."""

    manifest: dict[str, Any]
    replaced: frozenset[str]
    replaced_state: str | None = None
    folder: Folder | None = field(default=None, compare=False, repr=False)


class RecordExchange(Protocol):
    """How the ranks of one write exchange their shards' records. ``rank`` 0 commits; the others post."""

    rank: int

    def post(self, records: Mapping[str, ShardRecord], error: BaseException | None) -> None:
        """On a rank but 0: this rank's share is written (``records``), or it failed (``error``)."""

    def gather(self, url: str) -> tuple[dict[str, ShardRecord], Exception | None, dict[int, str]]:
        """On rank 0: the records the other writing ranks posted; the error that ended the wait, if any; and the
        ranks that posted a failure, each with its text. ``url`` names the handoff in a wait's message."""


def write_and_commit(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    *,
    metadata: Mapping[str, Any] | None,
    files: list[str] | None = None,
    exchange: RecordExchange | None = None,
    workers: int | None = None,
    retry: RetryPolicy | None = None,
    digest: str = _digest.DEFAULT,
    remove_root: bool = False,
    empty_before: bool = False,
) -> Commit | None:
    """Write ``files`` of ``plan`` (default: every shard), then commit; return the :class:`Commit` (None on a
    rank that only posts). Deletes nothing the commit replaced: :func:`remove_replaced`.

    ``exchange``: the ranks of a write by several; a failure of this rank's share is posted before it is raised
    (rank 0 would otherwise wait out its timeout), and on rank 0 every rank's failure deletes every shard of the
    write. ``remove_root``: a failed write removes the folder it created. ``empty_before``: the folder held no
    handoff, so a commit cut short (a Ctrl+C too) that did not land leaves nothing of this write.
    """
    records: dict[str, ShardRecord] = {}
    error: BaseException | None = None
    try:
        records = write_shards(fs, root, plan, files, workers=workers, retry=retry, digest=digest, remove_root=remove_root)
    except BaseException as exc:  # noqa: BLE001 - whatever ended this share, an interrupt too, is posted first
        if exchange is None:
            raise
        error = exc
    if exchange is not None:
        if exchange.rank != 0:
            exchange.post(records, error)
            if error is not None:
                raise error
            return None
        _gathered(fs, root, plan, exchange, records, error)
    try:
        return commit_handoff(fs, root, plan, records, metadata=metadata, retry=retry)
    except BaseException:  # a failed commit may have landed: its shards are then the handoff's
        if empty_before and not _committed_here(fs, root, records):  # no handoff there before, none of ours now
            Folder(fs, root).remove([*records, INDEX_NAME], empty_root=remove_root)
        raise  # else the shards are an interrupted save's, which the next save cleans up


def _gathered(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    exchange: RecordExchange,
    records: dict[str, ShardRecord],
    error: BaseException | None,
) -> None:
    """On rank 0: add the other ranks' records to ``records``, or, if any share failed, delete every shard of the
    write (the other ranks' once they are written) and raise."""
    url = url_of(fs, root)
    more, waited, failed = exchange.gather(url)
    records.update(more)
    error = error or waited
    if error is None and not failed:
        return
    delete_shards(fs, root, plan.shards)  # every rank's: a write that failed before its commit leaves nothing
    if error is not None:
        raise error
    shown = "; ".join(f"rank {r}: {text}" for r, text in failed.items())
    raise StorageTransferError(f"could not write the shards of {url!r} on {shown}{UNCHANGED}")


def _committed_here(fs: fsspec.AbstractFileSystem, root: str, files: Mapping[str, Any]) -> bool:
    """Whether the manifest in ``root`` names any of ``files``: a commit that failed may still have landed. When
    the store cannot say, it did, so that nothing is removed."""
    try:
        return bool(committed_shards(Folder(fs, root)) & set(files))
    except Exception:  # noqa: BLE001 - the store is failing
        return True


def write_and_replace(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    *,
    what: str = "",
    progress: bool | None = False,
    **kwargs: Any,
) -> dict[str, Any]:
    """A write by this process alone: :func:`write_and_commit` (``kwargs``: its arguments but ``exchange``), then
    the replaced handoff's files deleted; returns the manifest. ``progress``: a bar on stderr
    (:func:`stagesafe.progress.bytes_bar`, titled ``what``) counting the bytes the plan's lazy ``state_dict``
    reports through its ``on_read`` as it reads each tensor."""
    bar = bytes_bar(progress, plan.total_size, what)
    if bar is not None:
        plan.state_dict.on_read = bar.update
    try:
        done = write_and_commit(fs, root, plan, **kwargs)
    finally:
        if bar is not None:
            bar.close()
    assert done is not None  # no exchange: this process commits
    remove_replaced(done)
    return done.manifest


def commit(
    fs: fsspec.AbstractFileSystem, root: str, plan: HandoffPlan, shard_records: Mapping[str, ShardRecord], *,
    remove_stale_files: bool = True, **options: Any,
) -> dict[str, Any]:
    """Publish a handoff whose shards are all written; return its manifest. See :func:`commit_handoff`, whose
    keyword arguments (``metadata``, ``retry``) ``options`` are.

    ``remove_stale_files=False`` keeps the replaced handoff's files, for a caller that deletes them later
    with :func:`remove_replaced` (it then calls :func:`commit_handoff` to learn which they are).
    """
    done = commit_handoff(fs, root, plan, shard_records, **options)
    if remove_stale_files:
        remove_replaced(done)
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
    """Publish a handoff whose shards are all written: the manifest (the commit), then the index, written again
    while another writer's commit got in between, so that the two always end up agreeing.

    Deletes nothing: the files of the handoff it replaced are in the returned :class:`Commit`, for
    :func:`remove_replaced`. If writing the manifest fails, the new shards stay where they are (the manifest may
    have reached the store); a later save deletes them once they are old. Until the index is written it names
    the replaced handoff, whose files stay until then.
    """
    folder = Folder(fs, root, check_retry(retry))
    manifest = _manifest(folder, plan, shard_records, metadata)
    fsync_dir(fs, root)  # the shards' renames are durable before the manifest can name them
    before = committed_or_none(folder)
    replaced = set(before["shards"]) if before is not None else set()
    text = (readable_json(manifest) + "\n").encode()
    index = index_text(manifest)
    # Validated by build_manifest: a read of these bytes need not check them again.
    known_manifests.remember(known_manifests.key_of(text), frozenset(manifest["shards"]))
    folder.transfer(
        lambda: folder.write(MANIFEST_NAME, text),
        what=f"commit {folder.url!r} (write {MANIFEST_NAME})",
        hint="; the handoff there is the previous one or, if the last try reached the store, the new one: "
        "read_manifest says which",
        writing=True,
    )
    fsync_dir(fs, root)
    try:
        index_follows_the_manifest(folder, own=(text, index))
    except Exception as exc:  # noqa: BLE001 - committed: a stale index is repaired by the next save
        log.warning(
            "stagesafe: committed %s, but could not write its %s (%s); loaders that follow the index read the "
            "handoff before this one until `stagesafe verify --fix-index %s` or the next save rewrites it",
            folder.url, INDEX_NAME, exc, folder.url,
        )
    state = bound_folder(before) if before is not None else None
    return Commit(manifest=manifest, replaced=frozenset(replaced - set(manifest["shards"])),
                  replaced_state=state if state != bound_folder(manifest) else None, folder=Folder(fs, root))


def remove_replaced(done: Commit) -> None:
    """After a commit, in its folder: delete the shards of the handoff it replaced (and the optimizer state it
    named, which this one does not), and the files killed or failed writers left behind once they are older than
    :data:`~stagesafe.handoff.cleanup.ORPHAN_AGE` seconds (younger ones may belong to another writer's commit in
    progress). Best effort: a failure is logged, never raised, since the handoff is committed."""
    folder = done.folder
    assert folder is not None, "a Commit made by commit_handoff knows its folder"
    try:
        folder.remove(done.replaced)
        if done.replaced_state is not None:
            remove_state(folder.fs, folder.root, done.replaced_state)
        remove_orphans(folder)
    except Exception as exc:  # noqa: BLE001 - any storage client's error
        log.warning("stagesafe: could not delete stale files under %s (%s); a later save retries", folder.url, exc)


def write_index(folder: Folder, manifest: Mapping[str, Any]) -> None:
    """Write the Hugging Face index of ``manifest`` (the file loaders other than stagesafe follow)."""
    _write_index_text(folder, index_text(manifest))


def index_text(manifest: Mapping[str, Any]) -> bytes:
    """The bytes of the Hugging Face index of ``manifest``, as a commit writes them."""
    return (readable_json(build_index(manifest["weight_map"], manifest["total_size"]), sort_keys=True) + "\n").encode()


def _write_index_text(folder: Folder, index: bytes) -> None:
    folder.transfer(
        lambda: folder.write(INDEX_NAME, index),
        what=f"write {INDEX_NAME} to {folder.url!r}",
        hint=UNCHANGED,
        writing=True,
    )


def _manifest(
    folder: Folder,
    plan: HandoffPlan,
    shard_records: Mapping[str, ShardRecord],
    metadata: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The manifest of ``plan`` written as ``shard_records`` say, once every planned shard is written (and no
    other) with one digest."""
    unwritten = [f for f in plan.shards if f not in shard_records]
    unplanned = [f for f in shard_records if f not in plan.shards]
    if unwritten or unplanned:
        raise InvalidArgumentError(
            f"cannot commit {folder.url!r}: planned shards not written {unwritten[:3]}, written shards not planned "
            f"{unplanned[:3]}; write every shard of the plan with write_shard, then commit"
        )
    digests = {shard_records[f].digest for f in plan.shards}
    if len(digests) > 1:
        raise InvalidArgumentError(
            f"cannot commit {folder.url!r}: its shards were hashed with different digests {sorted(digests)}; a "
            "manifest records one, so write every shard of the plan with the same digest"
        )
    return build_manifest(
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


def index_follows_the_manifest(folder: Folder, *, own: tuple[bytes, bytes] | None = None) -> None:
    """Make the index describe the committed manifest, whichever writer committed last.

    Each writer writes its index after its manifest; with two writers at once, the last index written may
    belong to the commit that lost. A writer looks at the manifest, and writes the index from the manifest it
    finds until the two agree: the last writer to look always sees the last commit. ``own``: the bytes of the
    manifest this writer committed and of its index; while the manifest there is still those bytes, the index
    is compared byte for byte, and neither file is parsed.
    """
    where = f"{folder.url}/{MANIFEST_NAME}"
    for _ in range(_INDEX_ROUNDS):
        try:
            raw = committed_bytes(folder, explain=False)
            mine = own is not None and raw == own[0]
            manifest = None if mine else checked_manifest(raw, known_manifests.key_of(raw), where=where)
        except (HandoffNotFoundError, HandoffCorruptError):
            return
        try:
            current = folder.fs.cat_file(folder.path(INDEX_NAME))
        except (OSError, ValueError):
            current = None  # missing or unreadable: written below
        if manifest is None:  # this writer's manifest, still the committed one: its index is known byte for byte
            if current == own[1]:
                return
            _write_index_text(folder, own[1])
        elif current is None or not _same_weight_map(current, manifest):
            _write_index_text(folder, index_text(manifest))
        else:
            return


def _same_weight_map(index: bytes, manifest: Mapping[str, Any]) -> bool:
    try:
        return json.loads(index).get("weight_map") == manifest["weight_map"]
    except (ValueError, AttributeError):
        return False


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


_ONE_LINE = {sort: json.JSONEncoder(sort_keys=sort, separators=(", ", ": ")) for sort in (False, True)}
_STRING = json.encoder.encode_basestring_ascii  # what the encoders above write for a str (ensure_ascii)


def readable_json(value: Any, *, sort_keys: bool = False, depth: int = 0) -> str:
    """``json.dumps(value, indent=2)`` down to the second level, each deeper value on one line: the same JSON,
    and for an index the same bytes as transformers writes, but by the C encoder (``indent`` alone selects the
    pure-Python one: half a second at 20,000 tensors), one line per tensor."""
    if depth >= 2 or not isinstance(value, dict) or not value:
        return _ONE_LINE[sort_keys].encode(value)
    pad = "  " * (depth + 1)
    items = sorted(value.items()) if sort_keys else value.items()
    if depth:  # a table (tensors, weight map): one row per tensor
        body = ",\n".join(f"{pad}{_key(key)}: {_line(item, sort_keys)}" for key, item in items)
    else:
        body = ",\n".join(
            f"{pad}{_key(key)}: {readable_json(item, sort_keys=sort_keys, depth=1)}" for key, item in items
        )
    return "{\n" + body + "\n" + "  " * depth + "}"


def _key(key: Any) -> str:
    return _STRING(key) if type(key) is str else json.dumps(key)


def _line(value: Any, sort_keys: bool) -> str:
    """One table row on one line, as the encoder writes it; the two rows of every tensor, a name (weight map,
    aliases) and ``{"dtype", "shape"}``, are written here without the encoder's per-call set-up (a few
    microseconds a row, tens of thousands of rows)."""
    if type(value) is str:
        return _STRING(value)
    if type(value) is dict and len(value) == 2 and next(iter(value)) == "dtype":
        dtype, shape = value.get("dtype"), value.get("shape")
        if type(dtype) is str and type(shape) is list and all(type(d) is int for d in shape):
            return f'{{"dtype": {_STRING(dtype)}, "shape": [{", ".join(map(str, shape))}]}}'
    return _ONE_LINE[sort_keys].encode(value)
