"""storage/safe_files.py: a file a handoff or checkpoint names is opened only if it is a regular file inside its
folder, on a real local disk (links, loops, FIFOs, sockets, files swapped as they are opened) and on ``memory://``;
sizes come from the opened file, and a file over its limit is refused before it is read.

(Every reader refusing a link out of the folder or a FIFO is in tests/test_read.py and tests/test_zero_checkpoint.py;
a manifest replaced by a commit between the check and the open, in tests/test_store_concurrency.py.)
"""

from __future__ import annotations

import io
import os
import socket

import fsspec
import pytest
from _hostile import before_opening, opened_files, outside

from stagesafe.errors import HandoffCorruptError
from stagesafe.storage.fs import resolve
from stagesafe.storage.safe_files import open_in, read_in, size_of

pytestmark = pytest.mark.timeout(30)  # a reader that blocks on a FIFO fails instead of hanging

ERROR = {"error": HandoffCorruptError, "what": "the shard"}


@pytest.fixture
def folder(tmp_path):
    """A local folder with a regular file ``f`` (b"weights") and a file of the same bytes outside it."""
    inside = tmp_path / "handoff"
    inside.mkdir()
    (inside / "f").write_bytes(b"weights")
    (tmp_path / "elsewhere").write_bytes(b"weights")
    return inside


@pytest.fixture
def memory():
    fs, root = resolve("memory://stagesafe-tests/safe-files")
    fs.pipe_file(f"{root}/f", b"weights")
    fs.pipe_file(f"{root}/sub/g", b"x")
    yield fs, root
    fs.rm(root, recursive=True)


def _open(folder, name: str):
    return open_in(*resolve(str(folder)), name, **ERROR)


def test_a_regular_file_inside_the_folder_is_opened_unbuffered(folder):
    with _open(folder, "f") as f:
        assert isinstance(f, io.FileIO) and f.read() == b"weights"  # unbuffered: no read beyond what is asked


@pytest.mark.parametrize("name", ["", ".", "..", "../elsewhere", "sub/f", "sub\\f", "f\0", None])
def test_only_a_plain_file_name_is_opened(folder, memory, name):
    (folder / "sub").mkdir()
    (folder / "sub" / "f").write_bytes(b"x")
    for where in ((*resolve(str(folder)),), memory):
        with opened_files() as opened, pytest.raises(HandoffCorruptError, match=r"^the shard: .* not a plain file"):
            open_in(*where, name, **ERROR)
        assert opened == []


def test_links_are_followed_inside_the_folder_only(folder, tmp_path):
    (folder / "inside").symlink_to("f")
    with _open(folder, "inside") as f:
        assert f.read() == b"weights"
    (folder / "out").symlink_to(tmp_path / "elsewhere")
    with opened_files() as opened, pytest.raises(HandoffCorruptError, match=r"symbolic link to .*elsewhere.*outside"):
        _open(folder, "out")
    assert not outside(opened, str(folder))


def test_a_folder_reached_through_a_link_holds_its_files(folder, tmp_path):
    (tmp_path / "alias").symlink_to(folder)
    with _open(tmp_path / "alias", "f") as f:
        assert f.read() == b"weights"


def test_a_missing_file_or_dangling_link_is_file_not_found(folder):
    (folder / "dangling").symlink_to("nowhere")
    for name in ("missing", "dangling"):
        with pytest.raises(FileNotFoundError):
            _open(folder, name)


def test_a_link_loop_is_refused_in_one_message(folder):
    (folder / "a").symlink_to("b")
    (folder / "b").symlink_to("a")
    (folder / "self").symlink_to("self")
    loop = r"^the shard cannot be opened \(.*leads to itself\?\); it was not read$"
    for name in ("a", "self"):
        with pytest.raises(HandoffCorruptError, match=loop):
            _open(folder, name)


def test_what_is_not_a_regular_file_is_refused_unopened(folder):
    (folder / "dir").mkdir()
    os.mkfifo(folder / "pipe")
    (folder / "to-pipe").symlink_to("pipe")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(folder / "sock"))
        fifo = r"a FIFO \(named pipe\)"
        for name, kind in {"dir": "a directory", "pipe": fifo, "to-pipe": fifo, "sock": "a socket"}.items():
            with opened_files() as opened, pytest.raises(HandoffCorruptError, match=rf"is {kind}, not a regular"):
                _open(folder, name)
            assert opened == [], name
    finally:
        server.close()


def test_a_fifo_swapped_in_as_the_file_is_opened_is_refused_without_blocking(folder):
    """Between the check (a regular file) and the open, a FIFO takes the name: opened for reading as usual, it
    would wait for a writer forever."""
    path = os.path.realpath(folder / "f")

    def swap():
        os.remove(path)
        os.mkfifo(path)

    with before_opening(path, swap) as left, pytest.raises(HandoffCorruptError, match=r"is a FIFO"):
        _open(folder, "f")
    assert left[2] == 0  # the swap happened


def test_a_link_swapped_in_as_the_file_is_opened_is_not_followed(folder, tmp_path):
    path = os.path.realpath(folder / "f")

    def swap():
        os.remove(path)
        os.symlink(tmp_path / "elsewhere", path)

    with before_opening(path, swap), opened_files() as opened:
        with pytest.raises(HandoffCorruptError, match=r"^the shard changed while being opened"):
            _open(folder, "f")
    assert opened == [path]  # asked for once, the link not followed: elsewhere was never opened


def test_a_file_replaced_as_it_is_opened_is_checked_again_and_the_new_one_read(folder):
    path = os.path.realpath(folder / "f")

    def commit():
        (folder / "f.next").write_bytes(b"newer weights")
        os.replace(folder / "f.next", path)

    with before_opening(path, commit, times=2), opened_files() as opened:
        with _open(folder, "f") as f:
            assert f.read() == b"newer weights"
    assert opened.count(path) == 3


# -- other filesystems: a name is a key ------------------------------------------------------------------------------


def test_on_memory_a_file_is_read_and_a_folder_is_refused(memory):
    with open_in(*memory, "f", **ERROR) as f:
        assert f.read() == b"weights"
    with pytest.raises(HandoffCorruptError, match=r"^the shard is a 'directory', not a file"):
        open_in(*memory, "sub", **ERROR)
    with pytest.raises(FileNotFoundError):
        open_in(*memory, "missing", **ERROR)


# -- sizes and limits ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_file_up_to_its_limit_is_read_and_a_larger_one_refused_before_reading(folder, memory, where):
    fs, root = resolve(str(folder)) if where == "local" else memory
    assert read_in(fs, root, "f", limit=7, **ERROR) == b"weights"
    with pytest.raises(HandoffCorruptError, match=r"^the shard is 7 bytes, more than the 6 such a file can need"):
        read_in(fs, root, "f", limit=6, **ERROR)


def test_the_size_of_an_open_file_keeps_its_position(folder, memory):
    with _open(folder, "f") as local, open_in(*memory, "f", **ERROR) as remote:
        for f in (local, remote, io.BytesIO(b"weights")):
            f.seek(3)
            assert size_of(f) == 7 and f.tell() == 3
    with fsspec.open(f"memory://{memory[1]}/f", "rb") as f:  # a file without a descriptor
        f.read(2)
        assert size_of(f) == 7 and f.read() == b"ights"
