"""A handoff written by several ranks at once: each writes its share of the shards, rank 0 commits.

After a stage every rank holds the whole state dict (``between_stages="cpu"``), so each can write some of
the shards: write bandwidth, hashing, and the private copies a background write reads from are split across
ranks, and each rank's writer competes only with its own process for the GIL. Each rank plans alike, from the
same tensors and the write's key (the shard names' tag), writes its share and posts its shards' digests, or its
error, on the job's key-value store; rank 0 commits once it has heard from every writing rank, or deletes
every shard of the write and fails, leaving the committed handoff as it was. With one writing rank (the
ranks do not see one folder), rank 0 writes everything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stagesafe.errors import StorageTransferError
from stagesafe.storage.fs import resolve, url_of
from stagesafe.handoff.manifest import check_metadata
from stagesafe.handoff.names import tag_for
from stagesafe.handoff.cleanup import delete_shards
from stagesafe.handoff.commit import Commit, commit_handoff
from stagesafe.handoff.plan import HandoffPlan, dtype_name
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.handoff.shards import ShardRecord, write_shards
from stagesafe.stages.channel import JobChannel, Outcome, failures

__all__ = ["owners", "names_written_by", "write_share"]


def owners(plan: HandoffPlan, writers: int) -> dict[str, int]:
    """Which rank writes each shard: largest first, each to the rank with the fewest bytes so far."""
    sizes = {file: plan.shard_nbytes(file) for file in plan.shards}
    load = [0] * writers
    owner: dict[str, int] = {}
    for file in sorted(plan.shards, key=lambda f: -sizes[f]):  # sorted() is stable: ties keep the plan's order
        rank = min(range(writers), key=lambda r: (load[r], r))
        owner[file] = rank
        load[rank] += sizes[file]
    return {file: owner[file] for file in plan.shards}


def names_written_by(plan: HandoffPlan, *, rank: int, writers: int) -> set[str]:
    """The stored names whose shards ``rank`` writes in ``plan`` (none where it is not a writing rank)."""
    if rank >= writers:
        return set()
    return {name for file, owner in owners(plan, writers).items() if owner == rank for name in plan.shards[file]}


def write_share(
    values: Mapping[str, torch.Tensor],
    uri: str,
    storage_options: Mapping[str, Any] | None,
    *,
    max_shard_size: int | str,
    channel: JobChannel,
    writers: int,
    metadata: Mapping[str, Any],
    plan: HandoffPlan | None = None,
) -> Commit | None:
    """This rank's shards (ranks ``0 .. writers-1`` write); on rank 0, then the commit, whose :class:`Commit` it
    returns. ``plan``: the handoff's plan, made before (``values`` then need hold only this rank's names); by
    default it is made from ``values``. ``channel`` holds this write's keys (their prefix tags the shard names)."""
    fs, root = resolve(uri, dict(storage_options or {}))
    metadata = check_metadata(metadata)
    if plan is None:
        plan = plan_handoff(values, max_shard_size=max_shard_size)
    plan = plan.tagged(tag_for(channel.prefix), state_dict=values)
    mine = [file for file, owner in owners(plan, writers).items() if owner == channel.rank]
    _check_values(plan, mine)
    records: dict[str, ShardRecord] = {}
    error: BaseException | None = None
    try:
        records = write_shards(fs, root, plan, mine)
    except BaseException as exc:  # noqa: BLE001 - whatever ended this rank's share, an interrupt too, is posted:
        error = exc  # rank 0 would otherwise wait out the timeout for it; raised here too
    if channel.rank != 0:
        value = {f: [r.digest, r.hexdigest, r.size] for f, r in records.items()}
        channel.post_outcome(f"shards/{channel.rank}", Outcome.of(error, value))
        if error is not None:
            raise error
        return None
    waited, failed = _gather_records(channel, writers, records, url_of(fs, root))  # also after a failure here:
    error = error or waited  # the other ranks' shards are deleted only once they are written
    if error is None and not failed:
        return commit_handoff(fs, root, plan, records, metadata=metadata)  # a failure here may have committed
    delete_shards(fs, root, plan.shards)  # every rank's: a write that failed before its commit leaves nothing
    if error is not None:
        raise error
    shown = "; ".join(f"rank {r}: {text}" for r, text in failed.items())
    raise StorageTransferError(
        f"could not write the shards of {url_of(fs, root)!r} on {shown}; nothing was committed: "
        "the handoff there before, if any, is unchanged"
    )


def _check_values(plan: HandoffPlan, files: list[str]) -> None:
    """Each value this rank writes is the tensor the plan made room for: the plan was made when the stage
    started, and so were the private copies of these names."""
    for file in files:
        for name in plan.shards[file]:
            value, spec = plan.state_dict.get(name), plan.tensors[name]
            if value is None or dtype_name(value.dtype) != spec["dtype"] or list(value.shape) != list(spec["shape"]):
                got = "nothing" if value is None else f"{dtype_name(value.dtype)} {list(value.shape)}"
                raise RuntimeError(
                    f"stagesafe: the handoff's plan has {name!r} as {spec['dtype']} {spec['shape']}, but this rank "
                    f"was given {got} to write; this is a bug in stagesafe: please report it"
                )


def _gather_records(
    channel: JobChannel, writers: int, records: dict[str, ShardRecord], url: str
) -> tuple[Exception | None, dict[int, str]]:
    """On rank 0: add the other writing ranks' shard records to ``records``. Returns the error that ended the
    wait, if any, and the ranks that posted a failure, with its text."""
    others = range(1, writers)
    what = f"writing the handoff {url!r}: the shards of the other ranks"
    try:
        channel.wait([f"shards/{r}" for r in others], what=what)
        posted = {r: channel.outcome(f"shards/{r}") for r in others}
    except Exception as exc:  # noqa: BLE001 - raised by the caller, once this write's shards are gone
        return exc, {}
    for outcome in posted.values():
        if outcome.ok:
            shards = outcome.value.items()
            records.update({f: ShardRecord(digest=d, hexdigest=h, size=size) for f, (d, h, size) in shards})
    return None, failures(posted)
