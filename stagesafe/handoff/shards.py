"""Writing shard files: one with :func:`write_shard`, those of a plan with :func:`write_shards`, the one parallel
shard writer of every path (``save_state_dict``, the strategy's ranks, ``consolidate``).

A shard's bytes go straight from the tensors to the file, hashed on the way: no serialized copy of the shard.
Tensors are taken from the plan's state dict one at a time, as their bytes are due, so a lazy mapping (a
checkpoint read tensor by tensor) holds one tensor per shard in flight. Shards are written under names the
committed handoff does not use; :mod:`stagesafe.publishing.commit` then publishes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec

from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff import digest as _digest
from stagesafe.handoff import local_shards as _local_shards
from stagesafe.handoff.codec import encode_header
from stagesafe.storage.folder import Folder, check_retry, check_workers, each
from stagesafe.storage.fs import is_local
from stagesafe.handoff.names import is_shard_name
from stagesafe.handoff.plan import HandoffPlan, dtype_name
from stagesafe.handoff.tensor_bytes import SmallRun
from stagesafe.storage.retry import RetryPolicy

if TYPE_CHECKING:
    import torch

__all__ = ["UNCHANGED", "Pieces", "ShardRecord", "safetensors_chunks", "write_shard", "write_shards"]

UNCHANGED = "; nothing was committed: the handoff there before, if any, is unchanged"  # a failed write's hint

_WRITE_CHUNK = 128 * 1024 * 1024  # large: each piece costs the writer the GIL a few times, under a busy trainer


@dataclass(frozen=True)
class ShardRecord:
    """What :func:`~stagesafe.publishing.commit.commit` needs to know of a written shard: its ``digest`` (the name,
    e.g. ``xxh3-128-tree``), the ``hexdigest`` of its bytes, and its ``size``. Plain data, so ranks can gather it."""

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


def write_shards(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    files: Iterable[str] | None = None,
    *,
    workers: int | None = None,
    retry: RetryPolicy | None = None,
    digest: str = _digest.DEFAULT,
    remove_root: bool = False,
) -> dict[str, ShardRecord]:
    """Write the shards ``files`` of ``plan`` (default: all; a share of them: each rank of a job may write its
    own), ``workers`` at a time (default: 4 on a remote filesystem, up to 4 on a local disk); return their
    records, in the order of ``files``. :func:`~stagesafe.publishing.commit.commit` then publishes them all.

    Each shard's tensors are taken from ``plan.state_dict`` as their bytes are due (:func:`write_shard` with the
    plan's specs), so about ``workers`` tensors are in flight. If one shard fails, the others stop retrying,
    every shard this call started is deleted (and the folder itself with ``remove_root``, if that leaves it
    empty) and the error of the first failing shard is raised.
    """
    wanted = list(plan.shards) if files is None else list(files)
    unknown = [f for f in wanted if f not in plan.shards]
    if unknown:
        raise InvalidArgumentError(f"{unknown[:3]} are not shards of the plan; take the names from plan.shards")
    workers, retry, digest = check_workers(workers, fs), check_retry(retry), _digest.check_name(digest)
    lock = threading.Lock()
    started: list[str] = []
    written: dict[str, ShardRecord] = {}

    def one(file_name: str, stop: threading.Event) -> None:
        with lock:
            started.append(file_name)
        specs = plan.shard_specs(file_name)
        record = write_shard(fs, root, file_name, plan.state_dict, specs=specs, retry=retry, digest=digest, stop=stop)
        with lock:
            written[file_name] = record

    try:
        each(wanted, one, workers)
    except BaseException:
        # Ctrl+C too: a write cut short leaves none of its shards, nor a part of the one that failed (memory://
        # publishes a file as it is opened). Never a live file: the plan's names avoid the committed handoff's.
        # One try each: if the store is down, the next save deletes them.
        Folder(fs, root).remove(started, empty_root=remove_root)
        raise
    return {file_name: written[file_name] for file_name in wanted}


def write_shard(
    fs: fsspec.AbstractFileSystem,
    root: str,
    file_name: str,
    tensors: Mapping[str, torch.Tensor | Pieces],
    *,
    specs: Mapping[str, Mapping[str, Any]] | None = None,
    retry: RetryPolicy | None = None,
    digest: str = _digest.DEFAULT,
    stop: threading.Event | None = None,
) -> ShardRecord:
    """Write one shard file under ``root``, atomically, and return its digest and size for the manifest.

    The bytes go straight from the tensors to the file, hashed on the way with ``digest`` (one of
    :data:`stagesafe.handoff.digest.NAMES`): no serialized copy of the shard.
    Tensors are moved to the CPU and made contiguous; tensors whose bytes overlap (views of one another) are
    written as independent copies, which safetensors requires. With ``specs`` (name -> ``{"dtype", "shape"}``,
    as in ``HandoffPlan.tensors``) ``tensors`` may be a lazy mapping: each tensor is read only when its bytes
    are due and dropped after, so memory holds one tensor (small ones are copied into a run of up to 16 MiB
    written as one chunk, :mod:`~stagesafe.handoff.tensor_bytes`); a value may be :class:`Pieces`, written piece by
    piece without joining them. The write (one PUT or multipart upload on an object
    store) is tried again on transient errors as ``retry`` says, until ``stop`` is set (another shard failed).
    """
    folder = Folder(fs, root, check_retry(retry))
    digest = _digest.check_name(digest)
    if not is_shard_name(file_name):
        raise InvalidArgumentError(
            f"file_name={file_name!r} is not a shard name of the format; take it from a HandoffPlan"
        )
    if specs is None:
        tensors = _prepare(tensors)
        specs = {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for name, t in tensors.items()}
    header, size = encode_header(specs)
    digests: list[str] = []

    def stream() -> Iterator[bytes | memoryview]:
        """The shard's bytes straight from the tensors (no serialized copy), hashed on the way out by a thread
        of its own (and the pool it spreads a chunk over), so that hashing a chunk overlaps writing it and
        making the next; a lazy mapping is read one tensor at a time."""
        with _digest.Pipeline(digest) as hashing:
            for chunk in safetensors_chunks(header, specs, tensors):
                hashing.add(chunk)  # in order, and at most one chunk ahead of the file
                yield chunk
            digests.append(hashing.hexdigest())

    def attempt() -> None:
        chunks = stream()
        try:
            folder.write(file_name, chunks)
        finally:
            chunks.close()  # a write that stopped early: the hashing thread ends now, not when collected

    what = f"write shard {file_name!r} to {folder.url!r}"
    folder.transfer(attempt, what=what, stop=stop, hint=UNCHANGED, writing=True)
    if is_local(fs):
        _local_shards.remember(folder.path(file_name), digest, digests[-1])  # a load here need not hash it again
    return ShardRecord(digest=digest, hexdigest=digests[-1], size=size)


def safetensors_chunks(
    header: bytes, specs: Mapping[str, Mapping[str, Any]], tensors: Mapping[str, torch.Tensor | Pieces]
) -> Iterator[bytes | memoryview]:
    """A safetensors file's bytes in order, as chunks: the ``header``, then each tensor of ``specs`` as planned
    (consecutive small ones joined into one chunk; each checked against its plan first)."""
    yield header
    run = SmallRun()  # consecutive small tensors, written as one chunk (tensor_bytes.py)
    for name, spec in specs.items():
        value = tensors[name]
        if isinstance(value, Pieces):
            dtype, shape, parts, done = value.dtype, value.shape, value.parts, value.done
        elif SmallRun.takes(value):
            _check_planned(name, value.dtype, value.shape, spec)
            if run.add(value):
                yield run.take()
            del value
            continue
        else:
            parts, done = (value.detach().to("cpu").contiguous(),), None
            dtype, shape = parts[0].dtype, parts[0].shape
        _check_planned(name, dtype, shape, spec)
        if run.nbytes:
            yield run.take()
        for part in parts:
            data = _piece_bytes(part)
            if data is not None:
                for start in range(0, len(data), _WRITE_CHUNK):  # hashing one piece overlaps writing another
                    yield data[start : start + _WRITE_CHUNK]
                if done is not None:
                    done(part)
        del value, parts
    if run.nbytes:
        yield run.take()


def _check_planned(name: str, dtype: torch.dtype | str, shape: Iterable[int], spec: Mapping[str, Any]) -> None:
    if dtype_name(dtype) != spec["dtype"] or list(shape) != list(spec["shape"]):
        raise InvalidArgumentError(
            f"tensor {name!r} is {dtype_name(dtype)}{list(shape)} but was planned as "
            f"{spec['dtype']}{list(spec['shape'])}; the state dict changed while it was being written"
        )


def _piece_bytes(part: torch.Tensor | bytes | bytearray | memoryview) -> memoryview | None:
    """The bytes of a non-empty piece: bytes as they are, a tensor's values (torch is loaded if it is one)."""
    if isinstance(part, (bytes, bytearray, memoryview)):
        return memoryview(part).cast("B") if len(part) else None
    if not part.numel():
        return None
    import torch

    flat = part.contiguous().reshape(-1)
    if flat.stride(0) != 1:  # one element, sliced from a wider tensor: "contiguous", yet its stride is not 1
        flat = flat.clone(memory_format=torch.contiguous_format)
    return memoryview(flat.view(torch.uint8).numpy())


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
