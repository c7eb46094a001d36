"""The one commit protocol of a handoff: plan -> shards -> commit, whoever writes.

``save_state_dict``, ``consolidate`` and the strategy's writer all go through :func:`write_and_commit`: this
process writes its shards of the plan; the commit (manifest, then index) follows once every shard is written.
A handoff written by several ranks at once gives it a :class:`RecordExchange`, the small transport through which
each writing rank but 0 posts its shards' records (or its failure) and rank 0 gathers them: rank 0 commits once it
has heard from every writing rank, or deletes every shard of the write and fails, leaving the committed handoff
as it was. Nothing here knows how the ranks talk: the strategy's exchange is the job's key-value store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import fsspec

from stagesafe.errors import StorageTransferError
from stagesafe.handoff import digest as _digest
from stagesafe.handoff.cleanup import delete_shards
from stagesafe.publishing.commit import Commit, commit_handoff, remove_replaced
from stagesafe.handoff.names import INDEX_NAME
from stagesafe.handoff.plan import HandoffPlan
from stagesafe.handoff.read import committed_shards
from stagesafe.handoff.shards import UNCHANGED, ShardRecord, write_shards
from stagesafe.storage.folder import Folder
from stagesafe.storage.fs import url_of
from stagesafe.storage.retry import RetryPolicy
from stagesafe.progress import bytes_bar

__all__ = ["RecordExchange", "write_and_commit", "write_and_replace"]


class RecordExchange(Protocol):
    """How the ranks of one write exchange their shards' records. ``rank`` 0 commits; the others post."""

    rank: int

    def post(self, records: Mapping[str, ShardRecord], error: BaseException | None) -> None:
        """On a rank but 0: this rank's share is written (``records``), or it failed (``error``)."""

    def gather(self, url: str) -> tuple[dict[str, ShardRecord], Exception | None, dict[int, str]]:
        """On rank 0: the records the other writing ranks posted; the error that ended the wait, if any; and the
        ranks that posted a failure, each with its text. ``url`` names the handoff in a wait's message."""


def write_and_commit(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    *,
    metadata: Mapping[str, Any] | None,
    files: list[str] | None = None,
    exchange: RecordExchange | None = None,
    workers: int | None = None,
    retry: RetryPolicy | None = None,
    digest: str = _digest.DEFAULT,
    remove_root: bool = False,
    empty_before: bool = False,
) -> Commit | None:
    """Write ``files`` of ``plan`` (default: every shard), then commit; return the :class:`Commit` (None on a
    rank that only posts). Deletes nothing the commit replaced: :func:`~stagesafe.publishing.commit.remove_replaced`.

    ``exchange``: the ranks of a write by several; a failure of this rank's share is posted before it is raised
    (rank 0 would otherwise wait out its timeout), and on rank 0 every rank's failure deletes every shard of the
    write. ``remove_root``: a failed write removes the folder it created. ``empty_before``: the folder held no
    handoff, so a commit cut short (a Ctrl+C too) that did not land leaves nothing of this write.
    """
    records: dict[str, ShardRecord] = {}
    error: BaseException | None = None
    try:
        records = write_shards(fs, root, plan, files, workers=workers, retry=retry, digest=digest, remove_root=remove_root)
    except BaseException as exc:  # noqa: BLE001 - whatever ended this share, an interrupt too, is posted first
        if exchange is None:
            raise
        error = exc
    if exchange is not None:
        if exchange.rank != 0:
            exchange.post(records, error)
            if error is not None:
                raise error
            return None
        _gathered(fs, root, plan, exchange, records, error)
    try:
        return commit_handoff(fs, root, plan, records, metadata=metadata, retry=retry)
    except BaseException:  # a failed commit may have landed: its shards are then the handoff's
        if empty_before and not _committed_here(fs, root, records):  # no handoff there before, none of ours now
            Folder(fs, root).remove([*records, INDEX_NAME], empty_root=remove_root)
        raise  # else the shards are an interrupted save's, which the next save cleans up


def _gathered(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    exchange: RecordExchange,
    records: dict[str, ShardRecord],
    error: BaseException | None,
) -> None:
    """On rank 0: add the other ranks' records to ``records``, or, if any share failed, delete every shard of the
    write (the other ranks' once they are written) and raise."""
    url = url_of(fs, root)
    more, waited, failed = exchange.gather(url)
    records.update(more)
    error = error or waited
    if error is None and not failed:
        return
    delete_shards(fs, root, plan.shards)  # every rank's: a write that failed before its commit leaves nothing
    if error is not None:
        raise error
    shown = "; ".join(f"rank {r}: {text}" for r, text in failed.items())
    raise StorageTransferError(f"could not write the shards of {url!r} on {shown}{UNCHANGED}")


def _committed_here(fs: fsspec.AbstractFileSystem, root: str, files: Mapping[str, Any]) -> bool:
    """Whether the manifest in ``root`` names any of ``files``: a commit that failed may still have landed. When
    the store cannot say, it did, so that nothing is removed."""
    try:
        return bool(committed_shards(Folder(fs, root)) & set(files))
    except Exception:  # noqa: BLE001 - the store is failing
        return True


def write_and_replace(
    fs: fsspec.AbstractFileSystem,
    root: str,
    plan: HandoffPlan,
    *,
    what: str = "",
    progress: bool | None = False,
    **kwargs: Any,
) -> dict[str, Any]:
    """A write by this process alone: :func:`write_and_commit` (``kwargs``: its arguments but ``exchange``), then
    the replaced handoff's files deleted; returns the manifest. ``progress``: a bar on stderr
    (:func:`stagesafe.progress.bytes_bar`, titled ``what``) counting the bytes the plan's lazy ``state_dict``
    reports through its ``on_read`` as it reads each tensor."""
    bar = bytes_bar(progress, plan.total_size, what)
    if bar is not None:
        plan.state_dict.on_read = bar.update
    try:
        done = write_and_commit(fs, root, plan, **kwargs)
    finally:
        if bar is not None:
            bar.close()
    assert done is not None  # no exchange: this process commits
    remove_replaced(fs, root, done)
    return done.manifest
