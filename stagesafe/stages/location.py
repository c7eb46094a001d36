"""Where the handoff lives, as every rank sees it: checked once per strategy, at its first stage.

Every rank computes its handoff URL on its own (``<default_root_dir>/stagesafe_handoff`` by default), and
the ranks of a job need not see one folder: node-local disks of a multi-node job, or a different
``default_root_dir`` per rank (each rank its own ``tmp_path`` in Lightning's own tests). Rank 0 writes a
small token file into its folder; each rank looks for that token in its own. If every rank finds it, every
rank writes a share of each handoff; otherwise rank 0 writes the whole handoff into its folder and the other
ranks never read theirs. The token also shows, before any training, that the folder can be written.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from stagesafe.handoff.names import scratch_name
from stagesafe.handoff.shards import UNCHANGED
from stagesafe.storage.folder import read_small, remove_file, write_probe
from stagesafe.storage.fs import join, resolve, url_of
from stagesafe.stages import collectives
from stagesafe.stages.history import HandoffTarget

__all__ = ["Location", "agree_on_location"]


@dataclass(frozen=True)
class Location:
    """What the ranks agreed on about a handoff folder."""

    writer_id: str  # names this strategy's keys in the job's key-value store, the same on every rank
    writers: int  # ranks that write shares: all of them when every rank sees rank 0's folder, else 1
    folders: tuple[str, ...]  # each rank's URL, for messages


def agree_on_location(target: HandoffTarget) -> Location:
    """Check that rank 0 can write the handoff folder and which ranks see it. Collectives: every rank calls
    this at the same point, before any engine is built. Rank 0 failing to write its folder, or any rank to
    open its own, is raised on every rank."""
    options = dict(target.storage_options or {})

    def write_token() -> str:
        token = secrets.token_hex(8)
        fs, root = resolve(target.uri, options)
        write_probe(fs, root, _token_file(token), token.encode(), hint=UNCHANGED)
        return token

    def look(token: str) -> tuple[bool, str]:
        fs, root = resolve(target.uri, options)
        return read_small(fs, join(root, _token_file(token))) == token.encode(), url_of(fs, root)

    token = collectives.on_rank_zero(write_token, f"writing to the handoff folder {target.uri}")
    try:
        everyone = collectives.gather_all(lambda: look(token), f"looking for rank 0's token in {target.uri}")
    finally:
        if collectives.rank() == 0:  # every rank has looked: the token may go
            fs, root = resolve(target.uri, options)
            remove_file(fs, join(root, _token_file(token)))
    writers = collectives.world_size() if all(sees for sees, _ in everyone) else 1
    return Location(writer_id=token, writers=writers, folders=tuple(url for _, url in everyone))


def _token_file(token: str) -> str:
    return scratch_name(token)  # a name the handoff's own cleanup removes, should it be left behind
