"""storage/fs.py: URLs resolved to a filesystem and a path (local, ``file://``, ``memory://``, ``s3://`` resolved
without a request), joined with ``/``, named for messages; the backend a URL needs, named with how to install it;
listings that another writer cannot make stale; atomic publication on a local disk, ``memory://`` and S3 (moto's
server on loopback, tests/_s3.py).

(What a save or load says of an unknown protocol, or of a missing s3fs, gcsfs or adlfs, is in tests/test_read.py;
write-back of a long local write in tests/test_writeback.py.)
"""

from __future__ import annotations

import gc
import importlib.util
import os
import pathlib

import pytest
from _handoffs import url
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from stagesafe.errors import InvalidArgumentError, StorageBackendError
from stagesafe.storage.fs import (
    basename,
    bucket_of,
    fsync_dir,
    is_local,
    join,
    list_files,
    resolve,
    url_of,
    write_atomic,
)

pytestmark = pytest.mark.timeout(120)


# -- resolving a URL -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "kind", "path"),
    [
        ("/", LocalFileSystem, "/"),  # the root keeps its slash
        ("/data/run/", LocalFileSystem, "/data/run"),
        ("file:///data/run/", LocalFileSystem, "/data/run"),
        ("memory://run/", MemoryFileSystem, "/run"),
        ("memory:///a/b", MemoryFileSystem, "/a/b"),
    ],
)
def test_a_url_resolves_to_its_filesystem_and_a_path_without_a_trailing_slash(uri, kind, path):
    fs, got = resolve(uri)
    assert type(fs) is kind and got == path


def test_a_relative_path_resolves_to_the_folder_it_names_from_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = resolve("runs/handoff/")
    assert is_local(fs) and path == f"{tmp_path}/runs/handoff"


def test_an_s3_url_resolves_without_a_request_and_takes_the_storage_options():
    pytest.importorskip("s3fs")
    fs, path = resolve("s3://bucket/run/", {"anon": True, "endpoint_url": "http://127.0.0.1:9"})  # nothing listens
    assert path == "bucket/run" and fs.anon is True and not is_local(fs)
    assert url_of(fs, path) == "s3://bucket/run" and bucket_of(fs, path) == "bucket"
    fs, path = resolve("s3a://bucket", {"anon": True, "endpoint_url": "http://127.0.0.1:9"})
    assert path == "bucket" and bucket_of(fs, path) == "bucket"


def test_a_path_object_is_taken_but_one_that_pathlib_collapsed_from_a_url_is_refused(tmp_path):
    fs, path = resolve(tmp_path / "run")
    assert is_local(fs) and path == str(tmp_path / "run")
    with pytest.raises(InvalidArgumentError, match=r"'s3:/bucket/run' looks like a URL that pathlib collapsed"):
        resolve(pathlib.Path("s3://bucket/run"))


@pytest.mark.parametrize("uri", ["", None, b"/data/run", 7])
def test_what_is_not_a_non_empty_str_is_refused_naming_it(uri):
    with pytest.raises(InvalidArgumentError, match=rf"uri={uri!r} must be a non-empty str.*'s3://bucket/run'"):
        resolve(uri)


def test_an_unknown_protocol_in_a_chained_url_is_named():
    with pytest.raises(StorageBackendError, match=r"'simplecache::nosuchproto://b/x'.*protocol 'nosuchproto'"):
        resolve("simplecache::nosuchproto://b/x")


@pytest.mark.parametrize(
    ("uri", "package", "how"),
    [
        ("gs://bucket/run", "gcsfs", r"pip install 'stagesafe\[gcs\]' \(or pip install gcsfs\)"),
        ("simplecache::gs://bucket/run", "gcsfs", r"pip install 'stagesafe\[gcs\]'"),  # the layer that is missing
        ("oss://bucket/run", "ossfs", r"pip install ossfs$"),  # no extra of stagesafe installs it
    ],
)
def test_a_missing_backend_is_named_with_how_to_install_it(uri, package, how):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(StorageBackendError, match=rf"needs the {package} package for .*://.*{how}") as info:
        resolve(uri)
    assert isinstance(info.value, ImportError) and str(info.value).startswith(repr(uri))


def test_a_backend_that_fails_to_import_for_another_reason_says_so():
    """sftp:// is fsspec's own module, which needs paramiko: no package to name, fsspec's reason is shown."""
    if importlib.util.find_spec("paramiko") is not None:
        pytest.skip("paramiko is installed here")
    with pytest.raises(StorageBackendError, match=r"the fsspec backend could not be imported \(.*paramiko.*\)"):
        resolve("sftp://host/run")


# -- paths on a filesystem -------------------------------------------------------------------------------------------


def test_join_and_basename_use_slash_whatever_the_url():
    assert join("s3://bucket/run/", "model.safetensors") == "s3://bucket/run/model.safetensors"
    assert join("bucket/run", "x") == "bucket/run/x" and join("/", "x") == "/x" and join("", "x") == "/x"
    assert basename("s3://bucket/run/") == "run" and basename("/data/x.json") == "x.json"
    assert basename("name") == "name"


def test_messages_name_local_paths_as_typed_and_other_places_as_urls(tmp_path):
    fs, path = resolve(f"file://{tmp_path}/run")
    assert url_of(fs, path) == f"{tmp_path}/run"
    fs, path = resolve("memory://run")
    assert url_of(fs, path) == "memory:///run" and not is_local(fs)
    assert bucket_of(fs, path) is None and bucket_of(*resolve(str(tmp_path))) is None


# -- listing ---------------------------------------------------------------------------------------------------------


def test_files_and_folders_are_listed_apart_and_a_missing_folder_lists_nothing(url):
    fs, root = resolve(url)
    write_atomic(fs, join(root, "b.json"), b"{}")
    write_atomic(fs, join(root, "a.safetensors"), b"x")
    write_atomic(fs, join(root, "sub/c"), b"y")
    assert sorted(list_files(fs, root)) == ["a.safetensors", "b.json"]
    assert list_files(fs, root, kind="directory") == ["sub"]
    assert list_files(fs, join(root, "nothing-here")) == []
    assert list_files(fs, join(root, "b.json/under-a-file")) == []


def test_a_listing_on_s3_sees_what_another_writer_added_since_the_last(s3):
    url = s3.new_url()
    fs, root = resolve(url, s3.storage_options())
    write_atomic(fs, join(root, "a"), b"1")
    assert list_files(fs, root) == ["a"]
    s3.put(url, "b", b"2")  # another writer: not through this client
    s3.put(url, "sub/c", b"3")
    assert [basename(p) for p in fs.ls(root)] == ["a"]  # s3fs's own listing is still the cached one
    assert sorted(list_files(fs, root)) == ["a", "b"]
    assert list_files(fs, root, kind="directory") == ["sub"]


# -- publishing a file -----------------------------------------------------------------------------------------------


def test_bytes_and_streamed_chunks_are_published_whole(url):
    fs, root = resolve(url)
    write_atomic(fs, join(root, "deep/er/bytes"), b"abc")  # folders made as needed
    write_atomic(fs, join(root, "chunks"), iter([b"a", memoryview(b"bc"), bytearray(b"d"), b""]))
    write_atomic(fs, join(root, "view"), memoryview(b"whole"))
    write_atomic(fs, join(root, "view"), bytearray(b"again"))  # replaces
    assert fs.cat_file(join(root, "deep/er/bytes")) == b"abc" and fs.cat_file(join(root, "chunks")) == b"abcd"
    assert fs.cat_file(join(root, "view")) == b"again"
    assert sorted(list_files(fs, root)) == ["chunks", "view"]  # nothing else: no temporary file left


@pytest.mark.parametrize("cut", [RuntimeError("the source failed"), KeyboardInterrupt()], ids=["error", "ctrl_c"])
def test_a_local_stream_cut_short_leaves_the_old_file_and_no_temporary_one(tmp_path, cut):
    fs, root = resolve(str(tmp_path))
    path = join(root, "shard")
    write_atomic(fs, path, b"old")
    seen = []

    def chunks():
        yield b"new"
        seen.append((sorted(os.listdir(tmp_path)), (tmp_path / "shard").read_bytes()))  # mid-write
        raise cut

    with pytest.raises(type(cut)):
        write_atomic(fs, path, chunks())
    ((during, content),) = seen
    assert content == b"old" and len(during) == 2 and during[0] == "shard"  # the new bytes in a sibling
    assert os.listdir(tmp_path) == ["shard"] and (tmp_path / "shard").read_bytes() == b"old"


def test_a_memory_stream_cut_short_leaves_the_old_file():
    """memory:// publishes a file when it is opened: the stream is gathered first, so no reader sees a part."""
    fs, root = resolve("memory://stagesafe-tests/cut-short")
    path = join(root, "shard")
    write_atomic(fs, path, b"old")

    def chunks():
        yield b"new"
        raise RuntimeError("the source failed")

    try:
        with pytest.raises(RuntimeError):
            write_atomic(fs, path, chunks())
        gc.collect()
        assert fs.cat_file(path) == b"old"
    finally:
        fs.rm(root, recursive=True)


def _cut_short(size: int):
    """A stream of ``size`` bytes, then Ctrl+C."""
    yield bytes(size)
    raise KeyboardInterrupt


_PART = 5 * 2**20  # S3's smallest part: a stream longer than this is a multipart upload


def _uploads(s3, url: str) -> list:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    return s3.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])


def test_a_multipart_upload_cut_short_on_s3_is_aborted_and_the_old_object_stays(s3):
    url = s3.new_url()
    fs, root = resolve(url, s3.storage_options(default_block_size=_PART))
    path = join(root, "shard")
    write_atomic(fs, path, b"old")
    with s3.traffic() as seen, pytest.raises(KeyboardInterrupt):
        write_atomic(fs, path, _cut_short(_PART + 1))
    gc.collect()
    assert seen.paths("PUT", r"/shard$") and seen.paths("DELETE", r"/shard$")  # a part went up, then the abort
    assert s3.objects(url) == {"shard": b"old"} and _uploads(s3, url) == []
    write_atomic(fs, path, iter([b"a", b"b"]))  # a stream under a part: one PUT when it ends
    assert s3.objects(url) == {"shard": b"ab"}


def test_an_upload_whose_abort_fails_is_never_completed_later(s3):
    """The store refuses the abort: the file must not complete the upload when it is collected (fsspec closes an
    open file then, and closing completes an upload), or a truncated object would land under the name."""
    url = s3.new_url()
    fs, root = resolve(url, s3.storage_options(default_block_size=_PART))
    path = join(root, "shard")
    write_atomic(fs, path, b"old")
    s3.fail("DELETE", r"/shard$", 500, "InternalError")
    with pytest.raises(KeyboardInterrupt):
        write_atomic(fs, path, _cut_short(_PART + 1))
    s3.clear_rules()
    gc.collect()
    assert s3.objects(url) == {"shard": b"old"}
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    for upload in _uploads(s3, url):  # left for the bucket's lifecycle rule, as on a real store: tidy up here
        s3.client().abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def test_fsync_dir_asks_nothing_of_a_folder_that_is_gone_or_not_local(tmp_path):
    fsync_dir(*resolve(str(tmp_path)))
    fsync_dir(*resolve(str(tmp_path / "gone")))  # nothing to make durable: no error
    fsync_dir(*resolve("memory://stagesafe-tests/never-made"))
