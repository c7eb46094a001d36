"""Shard digests on plain bytes: known answers, the xxh3-128-tree definition, any chunking and any number of
threads giving one digest, a flipped byte anywhere changing it, and the readers that hash while they read."""

from __future__ import annotations

import ast
import hashlib
import io
import multiprocessing
import os
import pathlib

import pytest
import xxhash

import stagesafe.handoff.digest
import stagesafe.storage.workers
from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff.digest import (
    DEFAULT,
    LEAF,
    NAMES,
    Pipeline,
    check_name,
    hash_buffer,
    hash_file,
    is_hexdigest,
    new,
    read_hashed,
    threads,
)

DATA = os.urandom(2 * LEAF + 12345)  # three pieces of xxh3-128-tree, the last a short one


def test_module_imports_neither_torch_nor_fsspec():
    tree = ast.parse(pathlib.Path(stagesafe.handoff.digest.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {m.split(".")[0] for m in imported} <= {
        "__future__",
        "blake3",  # imported when a blake3 hasher is made
        "collections",
        "concurrent",
        "contextlib",
        "hashlib",
        "os",
        "stagesafe",
        "threading",
        "typing",
        "xxhash",  # imported when an xxh3-128-tree hasher is made
    }
    assert {m for m in imported if m.startswith("stagesafe")} == {"stagesafe.errors", "stagesafe.storage.workers"}
    pool = ast.parse(pathlib.Path(stagesafe.storage.workers.__file__).read_text())  # its thread pool: stdlib only
    pool_imports = {a.name for n in ast.walk(pool) if isinstance(n, ast.Import) for a in n.names}
    pool_imports |= {n.module for n in ast.walk(pool) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m.split(".")[0] for m in pool_imports} <= {"__future__", "collections", "concurrent", "queue",
                                                       "threading", "typing"}


def test_new_handoffs_record_xxh3_128_tree():
    assert DEFAULT == "xxh3-128-tree" and set(NAMES) == {"xxh3-128-tree", "blake3", "sha256"}


@pytest.mark.parametrize(
    ("name", "data", "expected"),
    [
        ("sha256", b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
        ("blake3", b"", "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"),  # BLAKE3's own vectors
        ("blake3", b"abc", "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"),
        # xxh3-128-tree's, fixed here so that the format cannot drift: handoffs written today must verify later
        ("xxh3-128-tree", b"", "2c0a8a99dc147d5445c3b49d035665b2"),
        ("xxh3-128-tree", b"abc", "00bb8f5bbcc6694e541b81f687d45e2f"),
        ("xxh3-128-tree", bytes(range(256)) * 40967, "7b82468df2bb1fdd1c630ddcc1bc32fb"),
    ],
)
def test_known_answers(name, data, expected):
    assert hash_buffer(name, data) == expected
    assert is_hexdigest(name, expected)


def _tree_by_its_definition(data: bytes) -> str:
    """xxh3-128-tree as docs/handoff-format.md defines it."""
    pieces = [data[i : i + 4 * 1024 * 1024] for i in range(0, len(data), 4 * 1024 * 1024)]
    digests = b"".join(xxhash.xxh3_128(piece).digest() for piece in pieces)
    return xxhash.xxh3_128(digests + len(data).to_bytes(8, "little")).hexdigest()


@pytest.mark.parametrize("length", [0, 1, LEAF - 1, LEAF, LEAF + 1, 2 * LEAF, len(DATA)])
@pytest.mark.parametrize("workers", [1, 4])
def test_xxh3_128_tree_follows_its_definition(length, workers):
    assert hash_buffer("xxh3-128-tree", DATA[:length], workers=workers) == _tree_by_its_definition(DATA[:length])


def test_other_digests_are_the_standard_ones():
    from blake3 import blake3

    assert hash_buffer("blake3", DATA) == blake3(DATA).hexdigest()  # what b3sum prints
    assert hash_buffer("sha256", DATA) == hashlib.sha256(DATA).hexdigest()  # what sha256sum prints


_CUTS = [
    [],  # one update
    [1, 2, 3],  # tiny first pieces
    [LEAF - 1, LEAF, LEAF + 1],  # a byte either side of a piece boundary
    [7, LEAF + 13, 2 * LEAF - 5],  # every update crossing a boundary
    list(range(0, len(DATA), 1_000_003)),  # many updates of an odd size
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("cuts", _CUTS, ids=["whole", "tiny", "at_boundaries", "across", "odd"])
@pytest.mark.parametrize("workers", [1, 3])
def test_any_chunking_on_any_number_of_threads_gives_one_digest(name, cuts, workers):
    whole = hash_buffer(name, DATA)
    bounds = [0, *cuts, len(DATA)]
    chunks = [memoryview(DATA)[a:b] for a, b in zip(bounds, bounds[1:])]
    hasher = new(name, workers=workers)
    for chunk in chunks:
        hasher.update(chunk)
    assert hasher.hexdigest() == whole
    with Pipeline(name, workers=workers) as hashing:
        for chunk in chunks:
            hashing.add(chunk)
        assert hashing.hexdigest() == whole


@pytest.mark.parametrize("name", NAMES)
def test_a_flipped_byte_anywhere_changes_the_digest(name):
    whole = hash_buffer(name, DATA)
    seen = {whole}
    for at in (0, LEAF - 1, LEAF, LEAF + 1, 2 * LEAF - 1, 2 * LEAF + 100, len(DATA) - 1):  # each piece, each edge
        changed = bytearray(DATA)
        changed[at] ^= 0x01
        found = hash_buffer(name, changed)
        assert found not in seen, f"a bit flipped at {at} was not seen by {name}"
        seen.add(found)
    assert hash_buffer(name, DATA + b"\0") != whole and hash_buffer(name, DATA[:-1]) != whole


def test_pipeline_is_done_with_a_chunk_once_the_next_is_added():
    first, second = bytearray(b"a" * 1000), bytearray(b"b" * 1000)
    with Pipeline(DEFAULT) as hashing:
        hashing.add(first)
        hashing.add(second)
        first[:] = b"x" * 1000  # the caller may reuse it now: it was hashed before add() returned
        assert hashing.hexdigest() == hash_buffer(DEFAULT, b"a" * 1000 + b"b" * 1000)


def test_pipeline_raises_what_hashing_raised():
    with Pipeline(DEFAULT) as hashing:
        hashing.add(12345)  # not a buffer
        with pytest.raises(TypeError):
            hashing.hexdigest()


class _File(io.RawIOBase):
    """A readable file that hands out at most ``step`` bytes per read and notes the buffers it filled."""

    def __init__(self, data: bytes, step: int) -> None:
        self._data, self._step, self._at = data, step, 0
        self.filled: set[int] = set()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._step, len(self._data) - self._at)
        view[:n] = self._data[self._at : self._at + n]
        self._at += n
        self.filled.add(id(view.obj))
        return n


@pytest.mark.parametrize("name", NAMES)
def test_read_hashed_fills_the_buffer_and_hashes_exactly_what_it_read(name):
    buffer = bytearray(len(DATA) + 1)  # one byte more than expected: a longer file shows
    n, found = read_hashed(_File(DATA, 999_999), buffer, name, chunk=3 * 1024 * 1024)
    assert n == len(DATA) and bytes(buffer[:n]) == DATA and found == hash_buffer(name, DATA)
    short = bytearray(LEAF)
    n, found = read_hashed(io.BytesIO(DATA), short, name)
    assert n == LEAF and found == hash_buffer(name, DATA[:LEAF])


@pytest.mark.parametrize("name", NAMES)
def test_hash_file_reuses_two_buffers_and_starts_with_the_head(name):
    f = _File(DATA, len(DATA))
    head = f.read(8)
    n, found = hash_file(f, len(DATA), name, head=head, chunk=1_000_000)  # ~9 chunks through 2 buffers
    assert n == len(DATA) - 8 and found == hash_buffer(name, DATA)
    assert len(f.filled) == 2
    n, found = hash_file(io.BytesIO(DATA), LEAF + 3, name)
    assert n == LEAF + 3 and found == hash_buffer(name, DATA[: LEAF + 3])
    assert hash_file(io.BytesIO(b""), 10, name) == (0, hash_buffer(name, b""))


def _hash_in_child(queue):
    queue.put(hash_buffer(DEFAULT, DATA, workers=2))


@pytest.mark.slow  # starts a process
def test_a_forked_child_hashes_on_threads_of_its_own():
    parent = hash_buffer(DEFAULT, DATA, workers=2)  # the parent's pool has threads now; a child has none of them
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_hash_in_child, args=(queue,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, "the child hung or died hashing on the pool it inherited"
    assert queue.get(timeout=5) == parent


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(InvalidArgumentError, match=r"digest='md5' is not one stagesafe knows; pass one of xxh3-128-tree"):
        check_name("md5")
    with pytest.raises(InvalidArgumentError, match="digest=None"):
        new(None)
    assert check_name("blake3") == "blake3"


def test_is_hexdigest_wants_lower_case_hex_of_the_digests_length():
    assert is_hexdigest("xxh3-128-tree", "0" * 32) and is_hexdigest("sha256", "0" * 64)
    assert not is_hexdigest("xxh3-128-tree", "0" * 64)
    assert not is_hexdigest("blake3", "A" * 64)
    assert not is_hexdigest("sha256", 7)


def test_threads_is_the_cpus_this_process_may_use():
    assert 1 <= threads() <= (os.cpu_count() or 1)
