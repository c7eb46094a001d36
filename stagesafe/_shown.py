"""Values shown in error messages: a ``repr`` bounded once for the whole value, whatever it holds.

A value read from a file may be megabytes long, or a structure that shares its parts at every level, whose whole
``repr`` doubles with each level (60 levels of records, each with two attributes pointing at the level below). A
bound per level restarts at every level and costs 2 ** depth all the same; here one budget of characters is
shared by the whole rendering: once it is spent, every container still open is closed with ``...``, so the work
is proportional to the message, not to the value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["clip", "shown"]

_DEPTH = 4  # levels of containers shown
_ITEMS = 20  # items of one container shown


def shown(value: Any, limit: int = 120) -> str:
    """``repr(value)`` on one line, cut to about ``limit`` characters, for an error message. A container is shown a
    few levels and items deep, from one budget of characters for the whole value. A value that defines
    ``__shown__`` (a stand-in of the pickle reader) is shown through it, within the same budget. Never raises: a
    part that cannot be shown (an integer of millions of digits) is named by its type."""
    return clip(_Rendering(limit).render(value, 0), limit)


def clip(text: str, limit: int = 120) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[: max(limit - 16, 8)]}... ({len(text)} chars)"


class _Rendering:
    """One value being shown: ``left`` is the count of characters still to write."""

    def __init__(self, limit: int):
        self.left = limit + 16

    def render(self, value: Any, depth: int) -> str:
        if self.left <= 0:
            return "..."
        try:
            parts = _parts(value)
            if parts is None:
                text = self._leaf(value)
                self.left -= len(text)
                return text
            head, items, tail, pairs = parts
        except Exception:  # noqa: BLE001 - RecursionError, ValueError (int digits), an odd object's own __repr__
            return f"<a {type(value).__name__} that cannot be shown>"
        self.left -= len(head) + len(tail)
        if depth >= _DEPTH:
            return f"{head}...{tail}"
        out = []
        for n, item in enumerate(items):
            if n == _ITEMS or self.left <= 0:
                out.append("...")
                break
            if pairs:
                out.append(f"{self.render(item[0], depth + 1)}: {self.render(item[1], depth + 1)}")
            else:
                out.append(self.render(item, depth + 1))
            self.left -= 2
        return head + ", ".join(out) + tail

    def _leaf(self, value: Any) -> str:
        if type(value) in (str, bytes, bytearray):
            cut = value[: self.left]
            return repr(cut) if len(cut) == len(value) else f"{cut!r}..."
        try:
            return " ".join(repr(value).split())  # one line: a numpy array's repr has several
        except Exception:  # noqa: BLE001 - see render
            return f"<a {type(value).__name__} that cannot be shown>"


def _parts(value: Any) -> tuple[str, Iterable[Any], str, bool] | None:
    """``(opening, items, closing, items are pairs)`` of a container, or None for a value shown by its ``repr``."""
    own = getattr(type(value), "__shown__", None)
    if own is not None:
        return own(value)
    if isinstance(value, dict):
        name = "" if type(value) is dict else f"{type(value).__name__}("
        return name + "{", value.items(), "}" + (")" if name else ""), True
    if isinstance(value, list):
        return "[", value, "]", False
    if isinstance(value, tuple):
        return "(", value, ",)" if len(value) == 1 else ")", False
    if isinstance(value, (set, frozenset)):
        name = "" if type(value) is set else f"{type(value).__name__}("
        return name + "{", value, "}" + (")" if name else ""), False
    return None
