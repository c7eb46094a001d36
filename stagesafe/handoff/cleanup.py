"""What may be deleted in a handoff's folder, and what must be left alone.

The committed handoff's files are live (:func:`live_files`) and never deleted here. Shards and temporary files
that no commit uses are what killed or failed writers left; they are deleted once older than
:data:`ORPHAN_AGE` (:func:`remove_stale`; younger ones may be another writer's commit in progress), and the
shards of a write that failed before its commit at once (:func:`delete_shards`). A folder holding a handoff is
refused unless the caller asks to replace it (:func:`refuse_existing_handoff`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

import fsspec

from stagesafe.errors import HandoffExistsError
from stagesafe.storage.folder import Folder, check_retry
from stagesafe.storage.fs import basename, list_files, resolve
from stagesafe.handoff.names import INDEX_NAME, MANIFEST_NAME, is_shard_name, is_temp_name
from stagesafe.handoff.read import committed_shards
from stagesafe.storage.retry import RetryPolicy

__all__ = [
    "ORPHAN_AGE", "delete_shards", "files_in_the_way", "live_files", "refuse_existing_handoff", "remove_orphans",
    "remove_stale",
]

log = logging.getLogger(__name__)

ORPHAN_AGE = 6 * 3600.0  # seconds: uncommitted shards and temporary files older than this are leftovers


def remove_stale(uri: str, *, storage_options: dict[str, Any] | None = None, older_than: float | None = None) -> None:
    """Delete what writers left behind at ``uri`` and no committed handoff uses: shards of interrupted or
    failed saves and temporary files, once older than ``older_than`` seconds (default :data:`ORPHAN_AGE`).
    Best effort: a failure is logged, never raised."""
    try:
        fs, root = resolve(uri, storage_options)
        remove_orphans(Folder(fs, root), older_than=older_than)
    except Exception as exc:  # noqa: BLE001 - any storage client's error
        log.warning("stagesafe: could not delete stale files under %s (%s); a later save retries", uri, exc)


def remove_orphans(folder: Folder, *, older_than: float | None = None) -> None:
    """Delete shard and temporary files that the committed handoff does not use and that are older than
    ``older_than`` seconds (default :data:`ORPHAN_AGE`): what killed or failed writers left. Younger ones may be
    another writer's commit in progress, and are left for a later save."""
    limit = ORPHAN_AGE if older_than is None else older_than
    fs, root = folder.fs, folder.root
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return
    keep = committed_shards(folder.tried_once())
    now = datetime.now(timezone.utc)
    old = []
    for entry in entries:
        name = basename(entry["name"])
        if entry.get("type") != "file" or name in keep or not (is_shard_name(name) or is_temp_name(name)):
            continue
        age = _file_age(entry, now)
        if age is not None and age >= limit:
            old.append(name)
    folder.remove(old)


def delete_shards(fs: fsspec.AbstractFileSystem, root: str, names: Iterable[str]) -> None:
    """Delete the shard files ``names`` of a write that failed before its commit (best effort: a file left
    over is deleted by a later save once it is old)."""
    Folder(fs, root).remove(names)


def live_files(fs: fsspec.AbstractFileSystem, root: str, *, retry: RetryPolicy | None = None) -> set[str]:
    """Files the committed handoff at ``root`` uses (none if there is none, or it cannot be read)."""
    return committed_shards(Folder(fs, root, check_retry(retry)))


def refuse_existing_handoff(fs: fsspec.AbstractFileSystem, root: str, *, retry: RetryPolicy | None = None) -> None:
    """What ``overwrite=False`` means everywhere: raise :class:`HandoffExistsError` if ``root`` holds a handoff
    or any of a handoff's files (shards, index); other files are no handoff's and are left alone."""
    folder = Folder(fs, root, check_retry(retry))
    names = folder.transfer(lambda: list_files(fs, root), what=f"list {folder.url!r}")
    present = [n for n in names if n in (MANIFEST_NAME, INDEX_NAME) or is_shard_name(n)]
    if present:
        what = "a handoff" if MANIFEST_NAME in present else f"model files {sorted(present)[:3]}"
        raise HandoffExistsError(
            f"{folder.url!r} already holds {what}; pass overwrite=True (CLI: --overwrite) to replace it "
            "atomically, or choose another folder"
        )


def files_in_the_way(
    fs: fsspec.AbstractFileSystem, root: str, *, overwrite: bool, retry: RetryPolicy | None = None
) -> set[str]:
    """What a new write to ``root`` must not use: with ``overwrite=False`` a folder holding a handoff is refused
    (:func:`refuse_existing_handoff`); the files of the committed handoff there (:func:`live_files`)."""
    if not overwrite:
        refuse_existing_handoff(fs, root, retry=retry)
    return live_files(fs, root, retry=retry)


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
