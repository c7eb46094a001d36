"""Saving a state dict as a handoff: the steps plan (:mod:`~stagesafe.handoff.plan`), write the shards
(:mod:`~stagesafe.handoff.shards`) and commit (:mod:`~stagesafe.publishing.commit`), composed.

The steps stay apart so that the ranks of a job can each write their own shards and one rank commits
(:mod:`stagesafe.stages.shared_write`); :func:`save_state_dict` and :func:`save_streamed` are the two ways a
single process saves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stagesafe.flags import checked_flag
from stagesafe.handoff import digest as _digest
from stagesafe.handoff.cleanup import files_in_the_way
from stagesafe.storage.folder import check_retry, check_workers
from stagesafe.storage.fs import check_not_a_file, resolve
from stagesafe.handoff.manifest import check_metadata
from stagesafe.handoff.sizes import DEFAULT_MAX_SHARD_SIZE
from stagesafe.handoff.plan import plan_specs
from stagesafe.publishing.commit import write_and_replace
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.storage.retry import RetryPolicy

if TYPE_CHECKING:
    import torch

__all__ = ["save_state_dict", "save_streamed"]


def save_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    uri: str,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    retry: RetryPolicy | None = None,
    digest: str = _digest.DEFAULT,
) -> dict[str, Any]:
    """Save ``state_dict`` as a handoff at ``uri``, replacing the one there atomically; return the manifest.

    ``metadata`` (JSON values) is stored in the manifest. A handoff already at ``uri`` is an error unless
    ``overwrite=True``, which replaces it atomically (:func:`~stagesafe.handoff.cleanup.refuse_existing_handoff`
    says what counts). ``digest`` is the hash recorded for every shard (:data:`stagesafe.handoff.digest.NAMES`;
    ``"sha256"`` writes a handoff that stagesafe versions before the digest was chosen can read too).
    ``workers`` shards are built and uploaded at a time (default: 4 on a remote filesystem, 1 on a local disk),
    so about that many shards are in flight at once. Every storage operation is tried again on transient
    errors as ``retry`` says (default :class:`~stagesafe.storage.retry.RetryPolicy`); if one still fails,
    ``StorageTransferError`` names it, the shards this call wrote are deleted and the handoff committed before
    is unchanged. Two processes saving to one ``uri`` at once never mix their files: the last commit wins
    whole, and neither deletes the other's shards.
    """
    overwrite = checked_flag("overwrite", overwrite)
    fs, root = resolve(uri, storage_options)
    check_not_a_file(fs, root, "uri")
    metadata = check_metadata(metadata)  # before anything is written
    workers = check_workers(workers, fs)
    retry = check_retry(retry)
    digest = _digest.check_name(digest)
    taken = files_in_the_way(fs, root, overwrite=overwrite, retry=retry)
    plan = plan_handoff(state_dict, max_shard_size=max_shard_size, taken=taken)
    return write_and_replace(fs, root, plan, metadata=metadata, workers=workers, retry=retry, digest=digest)


def save_streamed(
    specs: Mapping[str, Mapping[str, Any]],
    aliases: Mapping[str, str],
    tensors: Mapping[str, torch.Tensor],
    uri: str,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Save a state dict known only by ``specs`` (name -> ``{"dtype", "shape"}``), pulling each tensor from
    ``tensors`` exactly once, in ``specs`` order (aliases skipped), as its bytes are due.

    For sources that produce tensors on demand and cannot repeat themselves (a collective gather per tensor):
    shards are written one after the other, and not retried, since retrying would ask for a tensor twice.
    Memory holds one tensor. The commit protocol is :func:`save_state_dict`'s.
    """
    fs, root = resolve(uri, storage_options)
    check_not_a_file(fs, root, "uri")
    metadata = check_metadata(metadata)
    once = RetryPolicy(attempts=1)
    plan = plan_specs(specs, aliases, max_shard_size=max_shard_size, state_dict=tensors)
    return write_and_replace(fs, root, plan, metadata=metadata, workers=1, retry=once)
