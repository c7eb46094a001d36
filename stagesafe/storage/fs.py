"""fsspec plumbing under every folder stagesafe writes or reads: URL resolution with clear backend errors, atomic
writes (under a :func:`~stagesafe.storage.temp_names.temp_name` on a local disk).

Paths are ``str`` URLs resolved once with ``fsspec.core.url_to_fs``; paths on a filesystem are joined with
``/``, never ``os.path.join``, so ``s3://bucket/run`` stays a URL.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from collections.abc import Iterable
from typing import Any

import fsspec
from fsspec.core import split_protocol, url_to_fs
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations, registry

from stagesafe.errors import InvalidArgumentError, StorageBackendError, shown
from stagesafe.storage.temp_names import temp_name
from stagesafe.storage.writeback import EVERY, start_writeback

__all__ = [
    "basename",
    "bucket_of",
    "fsync_dir",
    "is_local",
    "join",
    "list_files",
    "resolve",
    "url_of",
    "write_atomic",
]

# fsspec backend package -> the stagesafe extra that installs it.
_EXTRAS = {"s3fs": "s3", "gcsfs": "gcs", "adlfs": "azure"}
# Protocols whose paths start with a bucket (or container) name.
_BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "oci"})


def resolve(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """``uri`` -> ``(filesystem, path on it)``; an unknown protocol or missing backend is a ``StorageBackendError``."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:/[^/]", uri):  # pathlib.Path("s3://b/x") collapses to "s3:/b/x"
            raise InvalidArgumentError(f"{uri!r} looks like a URL that pathlib collapsed; pass the URL as a str")
    if not isinstance(uri, str) or not uri:
        raise InvalidArgumentError(
            f"uri={uri!r} must be a non-empty str: a local path or an fsspec URL like 's3://bucket/run'"
        )
    if "\0" in uri:
        raise InvalidArgumentError(
            f"{shown(uri, 200)} holds a NUL character (\\x00), which no path or URL can hold: check how it was built"
        )
    for part in uri.split("::"):
        protocol, _ = split_protocol(part)
        if protocol and protocol not in known_implementations and protocol not in registry:
            raise StorageBackendError(
                f"{uri!r}: no filesystem is known for protocol {protocol!r}; check the spelling "
                "(fsspec knows e.g. file, memory, s3, gs, az, hf) or install the package that registers it"
            )
    try:
        fs, path = url_to_fs(uri, **(storage_options or {}))
    except ImportError as exc:
        raise StorageBackendError(_missing_backend(uri, exc)) from exc
    return fs, (path.rstrip("/") or path)


def check_not_a_file(fs: fsspec.AbstractFileSystem, root: str, name: str) -> None:
    """Refuse a destination on the local disk that is an existing file (a handoff is a folder: the shards and
    the manifest go inside it); a remote store is not asked, its "folders" are prefixes."""
    if is_local(fs) and os.path.lexists(root) and not os.path.isdir(root):
        raise InvalidArgumentError(
            f"{name}={shown(url_of(fs, root), 200)} is a file, not a folder: a handoff is a folder of shards and a "
            "manifest; pass a folder (it is created if missing), or move the file away"
        )


def _missing_backend(uri: str, exc: ImportError) -> str:
    for part in uri.split("::"):
        protocol, _ = split_protocol(part)
        impl = known_implementations.get(protocol or "")
        if impl is None:
            continue
        package = impl["class"].split(".")[0]
        if importlib.util.find_spec(package) is not None:
            continue
        extra = _EXTRAS.get(package)
        how = f"pip install 'stagesafe[{extra}]' (or pip install {package})" if extra else f"pip install {package}"
        return f"{uri!r} needs the {package} package for {protocol}:// URLs, which is not installed: {how}"
    return f"{uri!r}: the fsspec backend could not be imported ({exc}); install it"


def join(root: str, name: str) -> str:
    """``root/name`` with the filesystem's ``/``."""
    return f"{root.rstrip('/')}/{name}"


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def url_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A URL for messages: ``memory:///x``, ``s3://b/x``; local paths stay plain paths, as users typed them."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def bucket_of(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """The bucket (or container) ``path`` lies in on an object store, ``None`` on other filesystems."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols.isdisjoint(_BUCKET_PROTOCOLS):
        return None
    return path.lstrip("/").split("/", 1)[0] or None


def list_files(fs: fsspec.AbstractFileSystem, root: str, *, kind: str = "file") -> list[str]:
    """Names of the files (or, with ``kind="directory"``, folders) directly under ``root``; none if it does not
    exist. Bypasses fsspec's listing cache, which another writer may have made stale."""
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [basename(e["name"]) for e in entries if e.get("type") == kind]


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes | Iterable[bytes | memoryview]) -> None:
    """Publish ``data`` (bytes, or chunks streamed one at a time) at ``path``; no reader sees a partial file.

    Locally: write a temporary sibling (its write-back started as it grows), fsync, ``os.replace``. Object
    stores publish an object when its upload completes (s3fs: one PUT, or a multipart upload above its block
    size that is aborted, not completed, when writing fails), and have no cheap rename. ``memory://`` publishes
    a file as soon as it is opened, so its bytes are gathered first and put in place at once.
    """
    chunks = (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
    if not is_local(fs):
        if "memory" in _protocols(fs):  # it holds every byte in this process anyway
            data = b"".join(bytes(chunk) for chunk in chunks)
        if isinstance(data, (bytes, bytearray)):
            fs.pipe_file(path, bytes(data))
            return
        f = fs.open(path, "wb")
        try:
            for chunk in chunks:
                f.write(chunk)
        except BaseException:  # Ctrl+C too: an upload cut short must be aborted, never completed
            with contextlib.suppress(Exception):
                f.discard()  # s3fs: abort the multipart upload instead of completing it
            # Even when the abort fails (store down), the file must never be closed later: fsspec's __del__
            # would complete the upload, truncated, under the shard's name, perhaps over a newer handoff.
            with contextlib.suppress(Exception):
                f.closed = True
            raise
        f.close()
        return
    tmp = temp_name(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            written = started = 0
            for chunk in chunks:
                written += f.write(chunk)
                if written - started >= EVERY:  # the disk starts on this part while the next is written
                    f.flush()
                    start_writeback(f.fileno(), started, written - started)
                    started = written
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # Ctrl+C too: no temporary file is left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def fsync_dir(fs: fsspec.AbstractFileSystem, root: str) -> None:
    """Make renames under a local ``root`` durable before the next step relies on them (no-op elsewhere)."""
    if not is_local(fs):
        return
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
