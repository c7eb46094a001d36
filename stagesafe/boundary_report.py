"""What one stage boundary did: plain data, imported by whoever fills it (the boundary, the publisher), keeps it
(the strategy) or says it (the strategy's messages), without importing any of them."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BoundaryReport"]


@dataclass
class BoundaryReport:
    """What one stage boundary did, for logs and the demo."""

    stage: str
    uri: str
    seconds: float = 0.0  # leaving the stage: consolidate, destroy, restore, start the write
    enter_seconds: float = 0.0  # entering it: the clean check, host memory, the engine's partitions from a handoff,
    # and once the engine is built, a fit's exact fp32 values loaded into its masters
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step (the writer's too, once it ran)
    wrote: bool = False  # a handoff write of this stage's weights was started
    handoff_bytes: int = 0
    stale_problems: list[str] = field(default_factory=list)
    copied_while_waiting: int = 0  # bytes cloned for the background writer before the call could return

    @property
    def clean(self) -> bool:
        return not self.stale_problems
