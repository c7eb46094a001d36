"""Who owns a handoff folder: a handoff belongs to the run that wrote it, and another run never replaces it silently.

Every handoff the strategy writes records its run in the manifest's metadata (``run``: an id of the process
that wrote it, when that process started). At its first call a strategy claims its folder once, rank 0 deciding
for every rank before any engine is built. The folder is this run's when it holds no committed handoff, one
this process wrote (an earlier call, perhaps of another Trainer), or the handoff the strategy resumes from, or
when the user said to replace it (``overwrite_handoff=True``). Otherwise, as Lightning never clobbers a run's
files (``version_N``, ``-v1``): the default folder gives way to the first of ``stagesafe_handoff-v1``,
``-v2``, ... that is this run's to write, and rank 0 says where; a folder the user named is refused with
:class:`~stagesafe.errors.HandoffExistsError` on every rank, saying what it holds and the ways forward.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from stagesafe.errors import HandoffExistsError, HandoffNotFoundError
from stagesafe.handoff.read import read_manifest
from stagesafe.storage.retry import RetryPolicy
from stagesafe.stages import collectives

__all__ = ["RUN", "claim_folder", "versioned"]

# This process's run, recorded in every handoff it writes (rank 0's is the one a commit keeps).
RUN = {"id": secrets.token_hex(8), "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
_MAX_VERSIONS = 1000


def versioned(uri: str, version: int) -> str:
    """Lightning's naming of a run's own copy: ``.../stagesafe_handoff-v1``, ``-v2``, ..."""
    return f"{uri.rstrip('/')}-v{version}"


def claim_folder(
    uri: str,
    storage_options: Mapping[str, Any] | None,
    *,
    named: bool,
    resume_from: str | None,
    overwrite: bool,
) -> str:
    """The folder this run writes its handoff to (a collective: every rank calls it). Rank 0 looks at its own
    ``uri`` and decides for every rank: each keeps its own folder, or takes the same version of it (a rank
    that does not see rank 0's folder never reads its own). ``named``: the user passed ``uri`` (refused when
    another run's handoff is there); else it is the default folder (a versioned one is taken instead)."""
    options = dict(storage_options or {})

    def decide() -> tuple[int, str | None]:
        candidate, version = uri, 0
        while True:
            other = _another_runs(candidate, options, resume_from=resume_from, overwrite=overwrite)
            if other is None:
                return version, None
            if named or version >= _MAX_VERSIONS:
                return version, _refusal(candidate, other)
            version += 1
            candidate = versioned(uri, version)

    version, refusal = collectives.on_rank_zero(decide, f"looking at the handoff folder {uri}")
    if refusal is not None:
        raise HandoffExistsError(refusal)  # on every rank, before any step
    return versioned(uri, version) if version else uri


def _another_runs(
    uri: str, options: dict[str, Any], *, resume_from: str | None, overwrite: bool
) -> Mapping[str, Any] | None:
    """The metadata of a committed handoff at ``uri`` that this run does not own, or None."""
    if overwrite or (resume_from is not None and resume_from.rstrip("/") == uri.rstrip("/")):
        return None
    try:
        manifest = read_manifest(uri, storage_options=options or None, retry=RetryPolicy(attempts=1))
    except HandoffNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - damaged or unreadable: a handoff is there all the same, not ours
        return {}
    metadata = manifest.get("metadata") or {}
    run = metadata.get("run") if isinstance(metadata, dict) else None
    if isinstance(run, dict) and run.get("id") == RUN["id"]:
        return None
    return {**(metadata if isinstance(metadata, dict) else {}), "committed": manifest.get("created")}


def _refusal(uri: str, metadata: Mapping[str, Any]) -> str:
    """What the folder holds (stage, step, when) and the ways forward."""
    run = metadata.get("run") if isinstance(metadata.get("run"), dict) else {}
    held = ", ".join(
        part for part in (
            f"from {metadata['stage']}" if metadata.get("stage") else "",
            f"step {metadata['global_step']}" if metadata.get("global_step") is not None else "",
            f"committed {metadata['committed']}" if metadata.get("committed") else "",
            f"by a run started {run['started']}" if run.get("started") else "",
        ) if part
    ) or "written by another run"
    return (
        f"handoff_uri={uri!r} holds a committed handoff of another run ({held}); this strategy would replace it. "
        f"Nothing was trained. To continue from it, pass resume_from={uri!r}; to keep it, pass another "
        "handoff_uri; to replace it, pass overwrite_handoff=True"
    )
