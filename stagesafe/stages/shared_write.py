"""A handoff written by several ranks at once: each writes its share of the shards, rank 0 commits.

After a stage every rank holds the whole state dict (``between_stages="cpu"``), so each can write some of
the shards: write bandwidth, hashing, and the private copies a background write reads from are split across
ranks, and each rank's writer competes only with its own process for the GIL. Each rank plans alike, from the
same tensors and the write's key (the shard names' tag), and follows the handoff's one commit protocol
(:func:`~stagesafe.publishing.commit.write_and_commit`): it writes its share and posts its shards' digests, or its
error, on the job's key-value store (:class:`ChannelExchange`); rank 0 commits once it has heard from every
writing rank, or deletes every shard of the write and fails, leaving the committed handoff as it was. With one
writing rank (the ranks do not see one folder), rank 0 writes everything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stagesafe.handoff.manifest import check_metadata
from stagesafe.handoff.names import tag_for
from stagesafe.handoff.plan import HandoffPlan, dtype_name
from stagesafe.publishing.commit import Commit, write_and_commit
from stagesafe.handoff.shards import ShardRecord
from stagesafe.stages.channel import JobChannel, Outcome, failures
from stagesafe.storage.fs import resolve

__all__ = ["ChannelExchange", "owners", "names_written_by", "write_share"]


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
    plan: HandoffPlan,
    uri: str,
    storage_options: Mapping[str, Any] | None,
    *,
    channel: JobChannel,
    writers: int,
    metadata: Mapping[str, Any],
) -> Commit | None:
    """This rank's shards of ``plan`` (ranks ``0 .. writers-1`` write); on rank 0, then the commit, whose
    :class:`Commit` it returns. ``values`` hold at least this rank's names. ``channel`` holds this write's keys
    (their prefix tags the shard names)."""
    fs, root = resolve(uri, dict(storage_options or {}))
    metadata = check_metadata(metadata)
    plan = plan.tagged(tag_for(channel.prefix), state_dict=values)
    mine = [file for file, owner in owners(plan, writers).items() if owner == channel.rank]
    _check_values(plan, mine)
    exchange = ChannelExchange(channel, writers)
    return write_and_commit(fs, root, plan, metadata=metadata, files=mine, exchange=exchange)


class ChannelExchange:
    """The commit protocol's :class:`~stagesafe.publishing.commit.RecordExchange` over the job's key-value store:
    each rank posts its shards' records, or its error, under ``shards/<rank>`` of the write's channel."""

    def __init__(self, channel: JobChannel, writers: int) -> None:
        self.channel, self.writers, self.rank = channel, writers, channel.rank

    def post(self, records: Mapping[str, ShardRecord], error: BaseException | None) -> None:
        value = {f: [r.digest, r.hexdigest, r.size] for f, r in records.items()}
        self.channel.post_outcome(f"shards/{self.rank}", Outcome.of(error, value))

    def gather(self, url: str) -> tuple[dict[str, ShardRecord], Exception | None, dict[int, str]]:
        others = range(1, self.writers)
        what = f"writing the handoff {url!r}: the shards of the other ranks"
        try:
            self.channel.wait([f"shards/{r}" for r in others], what=what)
            posted = {r: self.channel.outcome(f"shards/{r}") for r in others}
        except Exception as exc:  # noqa: BLE001 - raised by the protocol, once this write's shards are gone
            return {}, exc, {}
        records: dict[str, ShardRecord] = {}
        for outcome in posted.values():
            if outcome.ok:
                shards = outcome.value.items()
                records.update({f: ShardRecord(digest=d, hexdigest=h, size=size) for f, (d, h, size) in shards})
        return records, None, failures(posted)


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

