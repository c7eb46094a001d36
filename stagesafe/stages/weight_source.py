"""Where the weights a stage ends with come from: decided once, when the stage ends, from plain facts.

A stage's end gives the module its weights back from one place, and falls back to the next when taking them
fails (a collective that broke, a handoff write that failed): nothing the module held may be lost. This module
holds that decision and nothing else (no torch), so each case is tested with plain values.
"""

from __future__ import annotations

import enum

__all__ = ["WeightSource", "weight_sources"]


class WeightSource(enum.Enum):
    """One place a stage's weights come from."""

    STREAMED = "streamed"  # a trained stage whose module goes back to meta tensors: the engine's fp32 masters,
    # gathered and written to the handoff one tensor at a time; the module takes none of them back
    MASTERS = "masters"  # a trained stage: the engine's fp32 masters, with frozen parameters and buffers
    BUILT = "built"  # an untrained stage: the weights it started with, plus the gathered partitions of the
    # parameters zero.Init built in this call (only the engine has their values)
    CHECKPOINT = "checkpoint"  # a ckpt_path checkpoint's weights, loaded during a stage whose engine's are not taken
    ENTRY = "entry"  # the weights the stage started with
    HANDOFF = "handoff"  # the handoff already holds them: a module of meta tensors takes nothing back

    @property
    def trained(self) -> bool:
        """The engine trained these weights: they are new, and the optimizer state beside them is kept."""
        return self in (WeightSource.STREAMED, WeightSource.MASTERS)


def weight_sources(
    *,
    engine: bool,
    gather: bool,
    trained: bool,
    meta: bool,
    built_here: bool,
    loaded: bool,
    in_handoff: bool,
) -> tuple[WeightSource, ...]:
    """The places a stage's weights come from, in order: each one after the first is where they come from
    when taking them from the one before failed; the last cannot fail.

    Args:
        engine: the stage's engine is still live.
        gather: every rank is at the stage's end, so the engine's weights may be gathered.
        trained: the stage was a ``fit``.
        meta: the module holds meta tensors between stages (``between_stages="meta"``).
        built_here: zero.Init built parameters in this call; only the engine holds their values.
        loaded: a ``ckpt_path`` checkpoint's weights were loaded during the stage.
        in_handoff: the stage's handoff holds the weights the stage started with.
    """
    if engine and gather and trained and meta:
        # a streamed write that fails leaves the trained weights in the module, not in a handoff
        return WeightSource.STREAMED, WeightSource.MASTERS, WeightSource.ENTRY
    unchanged = WeightSource.HANDOFF if meta and in_handoff else WeightSource.ENTRY
    if engine and gather and (trained or built_here):
        return (WeightSource.MASTERS if trained else WeightSource.BUILT), unchanged
    if loaded:
        return WeightSource.CHECKPOINT, unchanged
    return (unchanged,)
