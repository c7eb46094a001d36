"""Verifying a committed handoff: every shard re-hashed against its manifest, its contents and the index checked.

:func:`verify` streams each shard (memory stays bounded whatever its size) and checks what a load checks
(:mod:`stagesafe.handoff.read`): a regular file of the folder, of the manifest's size, digest, header and
tensors. It also checks the Hugging Face index, which loaders other than stagesafe follow, against the
manifest, and can rewrite an index that differs from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from stagesafe.errors import HandoffCorruptError, HandoffNotReadyError, shown
from stagesafe.flags import checked_flag, checked_optional_flag
from stagesafe.handoff import codec
from stagesafe.handoff import digest as _digest
from stagesafe.publishing.commit import index_follows_the_manifest, write_index
from stagesafe.storage.folder import Folder, check_workers, each
from stagesafe.handoff.manifest import digest_of
from stagesafe.handoff.names import INDEX_NAME, is_shard_name
from stagesafe.handoff.optimizer_state import open_form
from stagesafe.handoff.read import (
    MAX_JSON,
    ShardVanished,
    check_bytes,
    check_contents,
    fetch_manifest,
    missing_message,
    parse_json,
    shard_progress,
    while_unchanged,
)
from stagesafe.storage.retry import RetryPolicy
from stagesafe.storage.safe_files import open_in, read_in, size_of

__all__ = ["verify"]

log = logging.getLogger(__name__)

_COMMIT_GRACE = 2.0  # seconds an index that differs from the manifest may wait for its writer to write it


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
    stays bounded. Raises ``HandoffCorruptError`` naming the shard and what differs; returns the manifest. An
    index that names another save's shards, whole and in place (a save interrupted between its commit and its
    index), is no damage: ``HandoffNotReadyError`` says so and names the repair. ``fix_index``: an index that
    differs from the manifest is rewritten from it (once the shards verified, and only while that manifest is
    still the committed one) instead of being an error. ``progress``: a bar on stderr (default: on a terminal).
    The optimizer state a handoff's manifest names (``consolidate(..., optimizer=True)``) is verified too, and
    that it is the state these weights were written with.
    """
    fix_index = checked_flag("fix_index", fix_index)
    progress = checked_optional_flag("progress", progress, default="a bar when stderr is a terminal")
    folder = Folder.at(uri, storage_options, retry=retry)
    workers = check_workers(workers, folder.fs)
    folder.fs.invalidate_cache(folder.root)  # sizes must come from the store, not from a listing cached before a write
    manifest = fetch_manifest(folder)
    with shard_progress(progress, manifest, f"verifying {uri}") as on_read:
        manifest = while_unchanged(
            folder, manifest, lambda m: _verify(folder, m, workers=workers, fix_index=fix_index, on_read=on_read)
        )
    if "optimizer" in manifest["metadata"]:  # the optimizer state these weights name, bound and verified alike
        form = open_form(uri, storage_options=storage_options)
        assert form is not None
        verify(form.url, storage_options=storage_options, workers=workers, retry=retry, fix_index=fix_index,
               progress=progress)
    return manifest


def _verify(
    folder: Folder,
    manifest: dict[str, Any],
    *,
    workers: int,
    fix_index: bool,
    on_read: Callable[[int], None] | None,
) -> dict[str, Any]:
    def check(file_name: str, stop: threading.Event) -> None:
        _verify_shard(folder, manifest, file_name, stop=stop, on_read=on_read)

    # The index first, right after the manifest: a writer replacing the handoff while the shards are hashed
    # rewrites the index too, and only one read just after the manifest's can be expected to match it.
    stale = _index_difference(folder, manifest)
    each(list(manifest["shards"]), check, workers)
    if stale is not None:
        stale = _after_a_moment(folder, manifest, stale)  # a writer between its manifest and its index
    if stale is None:
        return manifest
    if fix_index:
        _rewrite_index(folder, manifest)
        log.warning("stagesafe: %s; it was rewritten from the manifest", stale.text)
        return manifest
    repair = (
        f"Rewrite the index from the manifest: stagesafe verify --fix-index {folder.url} (or stagesafe.verify(url, "
        "fix_index=True)), or save the handoff again"
    )
    if stale.interrupted:
        raise HandoffNotReadyError(
            f"{stale.text}. Nothing is damaged: the handoff's shards verified against the manifest, and loaders "
            f"that follow the index (transformers, safetensors' sharded loaders) read that whole older save. {repair}"
        )
    raise HandoffCorruptError(
        f"{stale.text}. Loaders that follow the index (transformers, safetensors' sharded loaders) would read "
        f"other tensors than the handoff holds; its shards verified against the manifest. {repair}"
    )


@dataclass(frozen=True)
class _IndexDifference:
    """How the index differs from the committed manifest. ``interrupted``: it is whole, the index of a set of
    shards all still in place, such as a save interrupted between its commit and its index leaves (nothing is
    damaged); otherwise the index itself is damaged."""

    text: str
    interrupted: bool = False


def _after_a_moment(folder: Folder, manifest: Mapping[str, Any], stale: _IndexDifference) -> _IndexDifference | None:
    """The index's difference once a writer in the middle of a commit had a moment to finish it: a save writes
    its index just after its manifest, so only a difference that stays is an interrupted save's. A handoff
    replaced meanwhile is verified again from its new manifest."""
    deadline = time.monotonic() + _COMMIT_GRACE
    while True:
        if fetch_manifest(folder) != manifest:
            raise ShardVanished(f"{folder.url!r} was replaced while it was verified")  # verified again, the new one
        if stale is None or time.monotonic() >= deadline:
            return stale
        time.sleep(0.02)
        stale = _index_difference(folder, manifest)


def _rewrite_index(folder: Folder, manifest: Mapping[str, Any]) -> None:
    """``--fix-index``: write the index of ``manifest`` only while it is still the committed one. A writer that
    committed meanwhile writes its own index; should its commit land between the look and the write, the index
    is made to follow it, and the new handoff is verified in its turn."""
    if fetch_manifest(folder) != manifest:
        raise ShardVanished(f"{folder.url!r} was replaced while it was verified")
    write_index(folder, manifest)
    if fetch_manifest(folder) != manifest:
        index_follows_the_manifest(folder)
        raise ShardVanished(f"{folder.url!r} was replaced while its index was rewritten")


def _verify_shard(
    folder: Folder,
    manifest: Mapping[str, Any],
    file_name: str,
    *,
    stop: threading.Event | None,
    on_read: Callable[[int], None] | None = None,
) -> None:
    """Check one shard as a load would, streaming it: a regular file of the folder, of the manifest's size,
    digest, header and tensors; memory stays bounded whatever its size."""
    url = folder.url
    source = f"{url!r}: shard {file_name!r}"

    def hashed() -> tuple[str, int, codec.Header | HandoffCorruptError]:
        with open_in(folder.fs, folder.root, file_name, error=HandoffCorruptError, what=source) as f:
            size = size_of(f)
            check_bytes(url, manifest, file_name, size, None)  # before reading a byte of it
            return _hash_file(f, size, source, digest_of(manifest), on_read=on_read)

    try:
        digest, done, header = folder.transfer(hashed, what=f"read shard {file_name!r} of {url!r}", stop=stop)
    except FileNotFoundError:
        raise ShardVanished(missing_message(url, file_name)) from None
    check_bytes(url, manifest, file_name, done, digest)
    if isinstance(header, HandoffCorruptError):  # the hash matched, so only a forged manifest gets here
        raise header
    check_contents(url, manifest, file_name, {t.name: (t.dtype, list(t.shape)) for t in header.tensors})


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


def _index_difference(folder: Folder, manifest: Mapping[str, Any]) -> _IndexDifference | None:
    """How the Hugging Face index differs from the manifest (loaders read the index, not the manifest), or
    None where they agree. A missing or malformed index says so."""
    where = f"{folder.url}/{INDEX_NAME}"
    try:
        raw = folder.transfer(
            lambda: read_in(folder.fs, folder.root, INDEX_NAME, limit=MAX_JSON, error=HandoffCorruptError, what=where),
            what=f"read {where}",
        )
    except FileNotFoundError:
        return _IndexDifference(f"{where} is missing (a first save interrupted between its commit and its index "
                                "leaves none)", interrupted=True)
    try:
        weight_map, total_size = _index_entries(parse_json(raw, where), where)
    except HandoffCorruptError as exc:
        return _IndexDifference(str(exc).removesuffix("; write the handoff again"))
    if weight_map != manifest["weight_map"]:
        difference = f"{where} differs from the committed manifest: " + _weight_map_difference(
            weight_map, manifest["weight_map"]
        )
        if _index_of_an_interrupted_save(folder, weight_map, where):
            return _IndexDifference(
                f"{difference}. It is the index of another save, whole and still in place: a save was interrupted "
                "between its commit and its index (or, by an earlier stagesafe, before its manifest)",
                interrupted=True,
            )
        return _IndexDifference(difference)
    if total_size != manifest["total_size"]:
        return _IndexDifference(f"{where} says total_size {total_size}, the manifest {manifest['total_size']}")
    return None


def _weight_map_difference(found: Mapping[str, str], committed: Mapping[str, str]) -> str:
    """What an index's weight map lacks, adds and moves compared with the manifest's, an example of each."""
    missing = [n for n in committed if n not in found]
    extra = [n for n in found if n not in committed]
    moved = [n for n in committed if n in found and found[n] != committed[n]]
    parts = [f"{len(missing)} tensor(s) missing, e.g. {shown(missing[0])}" if missing else "",
             f"{len(extra)} tensor(s) the manifest does not have, e.g. {shown(extra[0])}" if extra else "",
             f"{len(moved)} tensor(s) in another shard, e.g. {shown(moved[0])} in {found[moved[0]]!r}, "
             f"the manifest's {committed[moved[0]]!r}" if moved else ""]
    return "; ".join(p for p in parts if p)


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


def _index_of_an_interrupted_save(folder: Folder, weight_map: Mapping[str, str], where: str) -> bool:
    """True when every shard the index names exists and holds exactly the tensors the index puts there: the
    index of a complete set of shards, such as the commit before a save that died between its manifest and its
    index leaves (or, written by an older stagesafe, a save that died between its index and its manifest).
    A shard that is not a regular file inside the folder is refused, not read."""
    by_shard: dict[str, set[str]] = {}
    for name, file_name in weight_map.items():
        by_shard.setdefault(file_name, set()).add(name)
    if not by_shard:  # names no shard at all: nothing shows it is a save's
        return False
    for file_name, names in by_shard.items():
        what = f"{where}: shard {file_name!r} it names"
        try:
            f = open_in(folder.fs, folder.root, file_name, error=HandoffCorruptError, what=what)
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
