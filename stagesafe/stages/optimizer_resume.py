"""The optimizer state beside a ``resume_from`` handoff, put into a ``fit``'s engine.

A fit whose module holds the weights it took from ``resume_from`` (no call has changed them since) continues the
optimizer state that handoff holds beside them, if it holds one (``stagesafe consolidate --optimizer``, or a
strategy's ``handoff_optimizer_state=True``): re-partitioned for this job's ranks and loaded. No Lightning here."""

from __future__ import annotations

from typing import Any

from stagesafe.stages import collectives
from stagesafe.stages.history import HandoffTarget
from stagesafe.zero import engine as zero_engine

__all__ = ["resume_optimizer"]


def resume_optimizer(engine: Any, source: HandoffTarget) -> bool:
    """Load the optimizer state beside the handoff ``source`` into ``engine``; False when it holds none (the
    optimizer then starts afresh from the weights). Every rank reads its share before any loads (collectives:
    every rank calls it), so a state one rank refuses is refused on every rank."""
    state = collectives.all_ranks(
        lambda: zero_engine.read_handoff_optimizer(engine, source.uri, storage_options=source.storage_options),
        f"reading the optimizer state beside the handoff {source.uri} (every rank reads its share of it: a "
        "node-local path is not visible from other nodes; use shared storage or an object store)",
    )
    if state is not None:
        zero_engine.load_optimizer_state(engine, state)
    return state is not None
