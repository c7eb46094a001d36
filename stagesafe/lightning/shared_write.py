"""A handoff written by every rank at once: each writes its share of the shards, rank 0 commits.

After a stage every rank holds the whole state dict (``restore="cpu"``), so each can write some of the
shards: write bandwidth, hashing, and the private copies a background write reads from are split across
ranks, and each rank's writer competes only with its own process for the GIL. The writes run in background
threads that never use collectives. Each plans alike, from the same tensors, the files the committed
handoff uses and a generation tag derived from both, then writes its share and posts its shards' hashes (or
its error) to the job's key-value store; rank 0 commits once it has heard from every rank, or fails the write,
leaving the committed handoff as it was. Only for storage every rank sees: an object store, or a local path
on a single node.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import fsspec
import torch
from fsspec.implementations.memory import MemoryFileSystem

from stagesafe.handoff.fs import is_local, resolve, url_of
from stagesafe.lightning.inflight import wait_for_keys
from stagesafe.handoff.plan import check_metadata
from stagesafe.errors import StorageTransferError
from stagesafe.handoff.store import HandoffPlan, ShardRecord, commit, live_files, plan_handoff, write_shards

__all__ = ["shared_by_all_ranks", "owners", "names_written_by", "write_share"]


def shared_by_all_ranks(fs: fsspec.AbstractFileSystem, *, single_node: bool) -> bool:
    """Whether a file one rank writes is visible to the others: not ``memory://`` (private to a process), and
    not a local path across nodes."""
    if isinstance(fs, MemoryFileSystem):
        return False
    return single_node or not is_local(fs)


def owners(plan: HandoffPlan, world: int) -> dict[str, int]:
    """Which rank writes each shard: largest first, each to the rank with the fewest bytes so far."""
    sizes = {file: plan.shard_nbytes(file) for file in plan.shards}
    load = [0] * world
    owner: dict[str, int] = {}
    for file in sorted(plan.shards, key=lambda f: -sizes[f]):  # sorted() is stable: ties keep the plan's order
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[file] = rank
        load[rank] += sizes[file]
    return {file: owner[file] for file in plan.shards}


def names_written_by(
    tensors: Mapping[str, torch.Tensor], *, max_shard_size: int | str, rank: int, world: int
) -> set[str]:
    """The names whose shards ``rank`` writes (which shard a tensor lands in does not depend on file names)."""
    plan = plan_handoff(tensors, max_shard_size=max_shard_size)
    return {name for file, owner in owners(plan, world).items() if owner == rank for name in plan.shards[file]}


def write_share(
    values: Mapping[str, torch.Tensor],
    uri: str,
    storage_options: Mapping[str, Any] | None,
    *,
    max_shard_size: int | str,
    rank: int,
    world: int,
    key: str,
    store: Any,
    metadata: Mapping[str, Any],
    remove_stale_files: bool = True,
) -> dict[str, Any] | None:
    """This rank's shards of ``values``; on rank 0, then the commit. Returns the manifest on rank 0.

    ``key`` (the same on every rank) names this write in the store; no rank commits or plans the next write
    before every rank has posted, so all ranks see the same committed files and plan the same names.
    ``remove_stale_files``: as in :func:`~stagesafe.handoff.store.commit`.
    """
    fs, root = resolve(uri, dict(storage_options or {}))
    metadata = check_metadata(metadata)
    taken = sorted(live_files(fs, root))
    tag = hashlib.sha256("\n".join([key, *taken]).encode()).hexdigest()[:8]  # new whenever the live files change
    plan = plan_handoff(values, max_shard_size=max_shard_size, taken=taken, tag=tag)
    mine = [file for file, owner in owners(plan, world).items() if owner == rank]
    records: dict[str, ShardRecord] = {}
    error: BaseException | None = None
    try:
        records = write_shards(fs, root, plan, mine)
    except BaseException as exc:  # noqa: BLE001 - posted for rank 0, then raised here too
        error = exc
    if rank != 0:
        if error is not None:
            posted: dict[str, Any] = {"error": f"{type(error).__name__}: {error}"}
        else:
            posted = {f: [r.sha256, r.size] for f, r in records.items()}
        store.set(f"{key}/shards/{rank}", json.dumps(posted))
        if error is not None:
            raise error
        return None
    others = [f"{key}/shards/{r}" for r in range(1, world)]
    if others:
        wait_for_keys(store, others)  # every rank has finished writing: none of its files is still being written
    failures = []
    for r, other in enumerate(others, start=1):
        posted = json.loads(store.get(other))
        if "error" in posted:
            failures.append(f"rank {r}: {posted['error']}")
        else:
            records.update({f: ShardRecord(sha256=sha, size=size) for f, (sha, size) in posted.items()})
    if error is not None:
        raise error
    if failures:
        raise StorageTransferError(
            f"could not write the shards of {url_of(fs, root)!r} on {'; '.join(failures)}; nothing was committed: "
            "the handoff there before, if any, is unchanged"
        )
    return commit(fs, root, plan, records, metadata=metadata, remove_stale_files=remove_stale_files)
