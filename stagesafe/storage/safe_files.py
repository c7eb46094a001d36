"""Open a file a handoff or a checkpoint names: a regular file inside its folder, and nothing else.

A crafted folder can make a name a symbolic link to another folder's file (a loader that joins paths then
reads another handoff's weights), a FIFO (opening it for reading blocks until a writer comes: forever), or a
device. Every reader goes through :func:`open_in`: the name is a plain file name; on a local disk the path,
symbolic links followed, lies inside the folder and is a regular file, checked before it is opened (opening a
device can have effects of its own) and again on the opened descriptor, which must be the very file checked.
The descriptor is opened non-blocking, so a FIFO swapped in between cannot block either. On other filesystems
(object stores, ``memory://``) a name is a key: there are no links, FIFOs or devices, and anything but a file
is refused. Sizes come from the opened file, so that callers check them before reading.
"""

from __future__ import annotations

import os
import stat
from typing import IO

import fsspec

from stagesafe.errors import StageSafeError, shown
from stagesafe.storage.fs import is_local, join

__all__ = ["open_in", "open_local", "read_in", "size_of"]

_OPEN_ROUNDS = 3  # opens started over because the file was replaced between its check and its open

_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)  # a FIFO opens at once instead of waiting for a writer
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_NOFOLLOW", 0)  # the path is already resolved: a link swapped in since is refused
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


def open_in(
    fs: fsspec.AbstractFileSystem, root: str, name: str, *, error: type[StageSafeError], what: str
) -> IO[bytes]:
    """Open ``root/name`` for reading, unbuffered; raise ``error`` naming it as ``what`` if it is not a plain
    name of a regular file inside ``root``. A missing file raises ``FileNotFoundError``, as ``open`` does."""
    if not is_local(fs):
        _check_name(name, error=error, what=what)
        path = join(root, name)
        kind = fs.info(path).get("type")
        if kind != "file":
            raise error(f"{what} is a {shown(kind)}, not a file; it was not read")
        return fs.open(path, "rb")
    return open_local(root, name, error=error, what=what)


def read_in(
    fs: fsspec.AbstractFileSystem, root: str, name: str, *, limit: int, error: type[StageSafeError], what: str
) -> bytes:
    """The content of ``root/name`` (see :func:`open_in`), which must be at most ``limit`` bytes: a larger file
    is an ``error`` before anything of it is read."""
    with open_in(fs, root, name, error=error, what=what) as f:
        size = size_of(f)
        if size > limit:
            raise error(f"{what} is {size} bytes, more than the {limit} such a file can need; it was not read")
        data = f.read(limit + 1)
    if len(data) > limit:  # grew since
        raise error(f"{what} grew past {limit} bytes while being read; it was not used")
    return data


def size_of(f: IO[bytes]) -> int:
    """The size of an open file, from the file itself (``fstat`` on a local disk); the position is kept."""
    try:
        return os.fstat(f.fileno()).st_size
    except (OSError, ValueError, AttributeError):  # no descriptor (io.UnsupportedOperation is both)
        here = f.tell()
        size = f.seek(0, os.SEEK_END)
        f.seek(here)
        return size


def open_local(root: str, name: str, *, error: type[StageSafeError], what: str) -> IO[bytes]:
    """:func:`open_in` for a folder on the local disk: ``root/name`` opened unbuffered, if it is a regular file
    inside ``root`` once symbolic links are followed; ``os.fstat(f.fileno())`` is the file checked.

    A file replaced between the check and the open (a writer committing a new manifest by renaming it over the
    old one) is checked and opened again, a few times, before it is refused."""
    _check_name(name, error=error, what=what)
    for _ in range(_OPEN_ROUNDS):
        try:
            return _open_checked(root, name, error=error, what=what)
        except _Replaced:
            pass
    raise error(f"{what} was replaced {_OPEN_ROUNDS} times while being opened; it was not read")


class _Replaced(Exception):
    """The file at the path is no longer the one that was checked."""


def _open_checked(root: str, name: str, *, error: type[StageSafeError], what: str) -> IO[bytes]:
    path = os.path.join(root, name)
    os.lstat(path)  # FileNotFoundError for a missing file (a dangling link too is checked below)
    folder = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([folder, real]) != folder:
        raise error(
            f"{what} is a symbolic link to {shown(real)}, outside the folder {shown(folder)}; a handoff or "
            "checkpoint holds its own files, copy the file into the folder instead of linking it"
        )
    try:
        checked = os.stat(real)  # FileNotFoundError for a dangling link
    except OSError as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        raise error(  # ELOOP: links that lead to each other; ENAMETOOLONG, ...
            f"{what} cannot be opened ({exc.strerror}: a symbolic link that leads to itself?); it was not read"
        ) from None
    if not stat.S_ISREG(checked.st_mode):
        raise error(f"{what} is {_kind(checked.st_mode)}, not a regular file; it was not opened")
    try:
        fd = os.open(real, _FLAGS)
    except OSError as exc:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        raise error(f"{what} changed while being opened ({exc.strerror}); it was not read") from None
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino):
            raise _Replaced()
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:  # Ctrl+C too: the descriptor is closed, not leaked
        os.close(fd)
        raise


def _check_name(name: str, *, error: type[StageSafeError], what: str) -> None:
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise error(f"{what}: {shown(name)} is not a plain file name; a file is named by its name alone")


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"
