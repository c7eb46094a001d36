"""The one check every on/off argument of the public API passes: a real ``bool``, nothing that merely converts to one.

``bool("false")`` is True: a flag read from a config file or an environment variable as text would turn on what
it meant to turn off (``trust_pickles="false"`` would run a checkpoint's code). So a flag is ``True`` or
``False``, and an optional one also ``None`` (its documented default); anything else is refused before any work.
"""

from __future__ import annotations

from typing import Any

from stagesafe.errors import InvalidArgumentError, shown

__all__ = ["checked_flag", "checked_optional_flag"]


def checked_flag(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``, else :class:`~stagesafe.errors.InvalidArgumentError` naming
    ``name``."""
    if type(value) is not bool:  # bool cannot be subclassed: numpy.bool_, 0, 1, "false" are refused
        raise InvalidArgumentError(
            f"{name}={shown(value, 60)} must be True or False (a bool; strings such as 'false' and numbers are "
            f"refused, since bool('false') is True): pass {name}=True or {name}=False"
        )
    return value


def checked_optional_flag(name: str, value: Any, *, default: str) -> bool | None:
    """``value`` if it is ``True``, ``False`` or ``None`` (which means ``default``, as the message says), else
    :class:`~stagesafe.errors.InvalidArgumentError`."""
    if value is None or type(value) is bool:
        return value
    raise InvalidArgumentError(
        f"{name}={shown(value, 60)} must be True, False or None ({default}); strings such as 'false' and numbers "
        f"are refused, since bool('false') is True"
    )
