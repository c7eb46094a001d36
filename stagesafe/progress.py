"""Progress bars for long work: a bar on a terminal, nothing in a non-interactive run (logs, CI, pipes)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["bytes_bar"]


def bytes_bar(enabled: bool | None, total: int, desc: str) -> Any | None:
    """A tqdm bar on stderr counting ``total`` bytes, in decimal units as the summaries print sizes ("470.5 MB"),
    or None: ``enabled`` False, or None and stderr not a terminal, or tqdm not installed. ``update(n)`` adds
    bytes (tqdm locks, so several threads may); ``close()`` clears it."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc, file=sys.stderr, leave=False)
