"""Reading a committed handoff: its manifest (:func:`read_manifest`), its shards whole (:func:`load_state_dict`)
or one at a time (:class:`HandoffReader`), and a cheap look that it is all there (:func:`check_present`).

Every shard is checked against the manifest before it is parsed: a regular file of the folder, of the
manifest's size before a byte of it is read, of its digest, holding the tensors the weight map puts there.
Readers see the last committed handoff, never a half-written one, and start over if a writer replaces it
while they read (:func:`while_unchanged`).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from stagesafe.errors import HandoffCorruptError, HandoffNotFoundError, HandoffNotReadyError, clip
from stagesafe.flags import checked_flag, checked_optional_flag
from stagesafe.handoff import digest as _digest
from stagesafe.handoff import known_manifests
from stagesafe.handoff import local_shards as _local_shards
from stagesafe.storage.folder import Folder, check_workers, each
from stagesafe.storage.fs import basename, bucket_of, is_local, join, list_files, url_of
from stagesafe.handoff.index import shard_names
from stagesafe.handoff.manifest import digest_of, shard_digest, validate_manifest
from stagesafe.handoff.names import INDEX_NAME, MANIFEST_NAME, is_commit_of, is_shard_name
from stagesafe.handoff.plan import dtype_name
from stagesafe.storage.retry import RetryPolicy
from stagesafe.storage.safe_files import open_in, read_in, size_of
from stagesafe.progress import bytes_bar

if TYPE_CHECKING:
    import torch

__all__ = [
    "HandoffReader",
    "ShardVanished",
    "check_bytes",
    "check_contents",
    "check_present",
    "checked_manifest",
    "committed_bytes",
    "committed_manifest",
    "committed_or_none",
    "committed_shards",
    "fetch_manifest",
    "is_live_commit",
    "load_state_dict",
    "missing_message",
    "parse_json",
    "read_shard",
    "read_manifest",
    "shard_progress",
    "while_unchanged",
]

T = TypeVar("T")
MAX_JSON = 256 * 1024 * 1024  # a manifest or index larger than this is refused unread (100k tensors: ~30 MB)
_PROGRESS_FROM = 1_000_000_000  # bytes from which a load shows a bar on a terminal unless told
_READ_ROUNDS = 8  # reads started over because a writer replaced the handoff meanwhile (about 1 s in all)


class ShardVanished(Exception):
    """A shard named by the manifest is not there (replaced by a newer handoff, or lost)."""


def read_manifest(
    uri: str, *, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
) -> dict[str, Any]:
    """The manifest of the committed handoff at ``uri`` (validated, shards not checked)."""
    return fetch_manifest(Folder.at(uri, storage_options, retry=retry))


def is_live_commit(uri: str, key: str, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Is the handoff committed at ``uri`` now the commit of the write keyed ``key`` (its shards carry that
    write's tag, :func:`~stagesafe.handoff.names.tag_for`)? Asked once, not tried again: raises
    :class:`HandoffNotFoundError` where no handoff is committed, and what the store raises where it cannot say."""
    manifest = read_manifest(uri, storage_options=storage_options, retry=RetryPolicy(attempts=1))
    return is_commit_of(manifest["shards"], key)


def check_present(uri: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Raise ``HandoffNotFoundError`` or ``HandoffCorruptError`` unless the committed handoff at ``uri`` is
    there whole: its manifest valid, every shard it names present with the size it records. Cheap (no shard
    is read); returns the manifest."""
    folder = Folder.at(uri, storage_options).tried_once()
    manifest = fetch_manifest(folder)
    fs, root = folder.fs, folder.root
    fs.invalidate_cache(root)
    sizes = {basename(e["name"]): e.get("size") for e in fs.ls(root, detail=True) if e.get("type") == "file"}
    for file_name in manifest["shards"]:
        if file_name not in sizes:
            raise HandoffCorruptError(missing_message(folder.url, file_name))
        check_bytes(folder.url, manifest, file_name, sizes[file_name], None)
    return manifest


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
    ``verify=False`` skips the digest of every shard (sizes and headers are still checked). Tensors lie in
    their shard's buffer (no copy), each over a storage of its own, as ``load_file``'s: ``torch.save`` takes
    them. Tied names come back as the same tensor object, in the order they were saved.
    ``progress``: a bar on stderr, shard by shard (default: on a terminal, for a handoff of a gigabyte or more).
    """
    verify = checked_flag("verify", verify)
    progress = checked_optional_flag("progress", progress, default="a bar on a terminal for a gigabyte or more")
    folder = Folder.at(uri, storage_options, retry=retry)
    workers = check_workers(workers, folder.fs)
    import torch

    device = torch.device(device)
    manifest = fetch_manifest(folder)
    with shard_progress(progress, manifest, f"loading {uri}", least=_PROGRESS_FROM) as on_shard:
        return while_unchanged(
            folder, manifest, lambda m: _load(folder, m, device, workers=workers, verify=verify, on_shard=on_shard)
        )


class HandoffReader(Mapping):
    """A committed handoff as a read-only mapping that holds one verified shard in memory at a time.

    For callers that take tensors one by one in their own order (feeding an engine layer by layer): memory
    stays near one shard whatever the model size. Tensors are in the manifest's order; tied names alias.
    """

    def __init__(
        self, uri: str, *, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
    ) -> None:
        self._folder = Folder.at(uri, storage_options, retry=retry)
        self.manifest = fetch_manifest(self._folder)
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
                tensors = _read_shard(self._folder, self.manifest, file_name, torch.device("cpu"))
            except ShardVanished as exc:
                raise HandoffCorruptError(f"{exc} (or a writer replaced the handoff while it was read)") from None
            self._cached = (file_name, tensors)
        return self._cached[1][stored]

    def __iter__(self) -> Iterator[str]:
        return iter(self.manifest["tensors"])

    def __len__(self) -> int:
        return len(self.manifest["tensors"])


def read_shard(folder: Folder, manifest: Mapping[str, Any], file_name: str) -> dict[str, torch.Tensor]:
    """One shard of the committed handoff ``manifest`` describes, checked as :func:`load_state_dict` checks it
    (size, digest, contents): its stored tensors, on the CPU. For a reader that takes a few slices of each."""
    import torch

    try:
        return _read_shard(folder, manifest, file_name, torch.device("cpu"))
    except ShardVanished as exc:
        raise HandoffCorruptError(f"{exc} (or a writer replaced the handoff while it was read)") from None


def fetch_manifest(folder: Folder) -> dict[str, Any]:
    """The committed manifest, read with the folder's retries."""
    return folder.transfer(lambda: committed_manifest(folder), what=f"read {folder.url}/{MANIFEST_NAME}")


def committed_manifest(folder: Folder, *, explain: bool = True) -> dict[str, Any]:
    """The committed manifest (one try). ``explain=False``: skip looking around for a helpful not-found message."""
    raw = committed_bytes(folder, explain=explain)
    return checked_manifest(raw, known_manifests.key_of(raw), where=f"{folder.url}/{MANIFEST_NAME}")


def committed_bytes(folder: Folder, *, explain: bool = True) -> bytes:
    """The committed manifest's bytes, unparsed (one try); ``HandoffNotFoundError`` if there is none."""
    where = f"{folder.url}/{MANIFEST_NAME}"
    try:
        return read_in(folder.fs, folder.root, MANIFEST_NAME, limit=MAX_JSON, error=HandoffCorruptError, what=where)
    except (FileNotFoundError, NotADirectoryError):
        message = _not_found_message(folder) if explain else f"no handoff at {folder.url!r}"
        raise HandoffNotFoundError(message) from None


def checked_manifest(raw: bytes, key: str, *, where: str) -> dict[str, Any]:
    """The manifest in ``raw`` (whose :func:`~stagesafe.handoff.known_manifests.key_of` is ``key``), validated
    unless the same bytes were found valid before (:mod:`~stagesafe.handoff.known_manifests`)."""
    manifest = parse_json(raw, where)
    if known_manifests.lookup(key) is None:
        validate_manifest(manifest, source=where)
        known_manifests.remember(key, frozenset(manifest["shards"]))
    return manifest


def committed_shards(folder: Folder) -> set[str]:
    """The shard files of the committed handoff in ``folder``; none if there is none or it cannot be read (its
    files are then left to the age rule of :func:`~stagesafe.handoff.cleanup.remove_stale`)."""

    def shards() -> set[str]:
        raw = committed_bytes(folder, explain=False)
        key = known_manifests.key_of(raw)
        known = known_manifests.lookup(key)  # bytes this process wrote or read: no need to parse them again
        if known is not None:
            return set(known)
        return set(checked_manifest(raw, key, where=f"{folder.url}/{MANIFEST_NAME}")["shards"])

    try:
        return folder.transfer(shards, what=f"read {folder.url}/{MANIFEST_NAME}")
    except (HandoffNotFoundError, HandoffCorruptError):
        return set()


def committed_or_none(folder: Folder) -> dict[str, Any] | None:
    """The committed manifest in ``folder`` (read with its retries), or None if there is none or it is damaged."""
    try:
        return folder.transfer(
            lambda: committed_manifest(folder, explain=False), what=f"read {folder.url}/{MANIFEST_NAME}"
        )
    except (HandoffNotFoundError, HandoffCorruptError):
        return None


def parse_json(raw: bytes, where: str) -> Any:
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


@contextlib.contextmanager
def shard_progress(
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


def while_unchanged(folder: Folder, manifest: dict[str, Any], read: Callable[[dict[str, Any]], T]) -> T:
    """``read(manifest)``, started over from the new manifest when a writer replaced the handoff meanwhile
    (and deleted the shards being read): only a handoff that stays committed while it is read is damaged."""
    for round_ in range(_READ_ROUNDS):
        try:
            return read(manifest)
        except (ShardVanished, HandoffCorruptError) as exc:
            newer = fetch_manifest(folder)
            if newer == manifest:
                if isinstance(exc, ShardVanished):
                    raise HandoffCorruptError(str(exc)) from None
                raise
            manifest = newer
            if 0 < round_ < _READ_ROUNDS - 1:  # a writer replacing it at once, again: give it a moment
                time.sleep(min(0.01 * 2**round_, 0.2))
    raise HandoffNotReadyError(  # not damage: every read met a newer handoff
        f"{folder.url!r} was replaced {_READ_ROUNDS} times while being read; read it again once its writer is done"
    )


def check_bytes(url: str, manifest: Mapping[str, Any], file_name: str, size: int, hexdigest: str | None) -> None:
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


def check_contents(
    url: str, manifest: Mapping[str, Any], file_name: str, found: Mapping[str, tuple[str, list[int]]]
) -> None:
    """The tensors a shard holds (``found``: name -> dtype, shape) must be exactly those the manifest's weight
    map puts there, with the dtype and shape it records."""
    expected = shard_names(manifest["weight_map"], list(manifest["shards"]))[file_name]
    described = manifest["tensors"]
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


def missing_message(url: str, file_name: str) -> str:
    """What to say of a shard the manifest names that is not there."""
    return f"{url!r}: shard {file_name!r} named by the manifest is missing; the handoff is incomplete, write it again"



def _load(
    folder: Folder,
    manifest: Mapping[str, Any],
    device: torch.device,
    *,
    workers: int,
    verify: bool,
    on_shard: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    def one(file_name: str, stop: threading.Event) -> dict[str, torch.Tensor]:
        tensors = _read_shard(folder, manifest, file_name, device, stop=stop, verify=verify)
        if on_shard is not None:
            on_shard(manifest["shards"][file_name]["size"])
        return tensors

    stored: dict[str, torch.Tensor] = {}
    for tensors in each(list(manifest["shards"]), one, workers).values():
        stored.update(tensors)
    aliases = manifest["aliases"]
    return {name: stored[aliases.get(name, name)] for name in manifest["tensors"]}


def _read_shard(
    folder: Folder,
    manifest: Mapping[str, Any],
    file_name: str,
    device: torch.device,
    *,
    stop: threading.Event | None = None,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """One shard's tensors, its size and digest checked against the manifest before it is parsed (without
    ``verify``, or for a local file this process has already hashed, its size only). The file must be a regular
    file of the folder, and its size the manifest's before a byte of it is read. A local file is mapped, as
    ``load_file`` maps it, and hashed through the mapping; a remote one is read into memory, each chunk hashed
    while the next arrives."""
    url, fs = folder.url, folder.fs
    size = manifest["shards"][file_name]["size"]
    digest, expected = digest_of(manifest), shard_digest(manifest, file_name)
    source = f"{url!r}: shard {file_name!r}"
    path = folder.path(file_name)

    import torch

    def read() -> tuple[torch.Tensor, str | None]:
        with open_in(fs, folder.root, file_name, error=HandoffCorruptError, what=source) as f:
            check_bytes(url, manifest, file_name, size_of(f), None)
            if is_local(fs) and (not verify or _local_shards.known(path, digest, expected, f=f)):
                return _local_shards.map_file(f, size), None
            if is_local(fs):
                buffer, found = _local_shards.map_hashed(f, size, digest)
                check_bytes(url, manifest, file_name, size_of(f), None)  # not cut or grown while it was hashed
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
        buffer, found = folder.transfer(read, what=f"read shard {file_name!r} of {url!r}", stop=stop)
    except FileNotFoundError:
        raise ShardVanished(missing_message(url, file_name)) from None
    check_bytes(url, manifest, file_name, buffer.numel(), found)
    tensors = _local_shards.tensors_in(buffer, source=source)  # the hash matched: only a forged manifest fails here
    found = {name: (dtype_name(t.dtype), list(t.shape)) for name, t in tensors.items()}
    check_contents(url, manifest, file_name, found)
    return {name: tensor if device.type == "cpu" else tensor.to(device) for name, tensor in tensors.items()}


def _not_found_message(folder: Folder) -> str:
    fs, root, url = folder.fs, folder.root, folder.url
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
