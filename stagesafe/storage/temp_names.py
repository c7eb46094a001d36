"""The temporary name a file is written under before the rename that publishes it, and its shape, so that a
format's cleanup can tell its own leftovers (a killed writer's) from a user's files. Pure: no storage call."""

from __future__ import annotations

import secrets

__all__ = ["TEMP_SUFFIX", "temp_name"]

TEMP_SUFFIX = r"\.tmp-[0-9a-f]+"  # a regular expression: what temp_name adds to the name it publishes


def temp_name(name: str, token: str | None = None) -> str:
    """The temporary name ``name`` is written under before the rename that publishes it (``token``: hex)."""
    return f"{name}.tmp-{token if token is not None else secrets.token_hex(4)}"
