"""Byte sizes as users give them (``max_shard_size="1GB"``, ``"1.5GiB"``, ``5_000_000``), and the one default.

Pure: the strategy, ``save_state_dict`` and the CLI check a size before anything starts, without torch.
"""

from __future__ import annotations

import re
from decimal import Decimal

from stagesafe.errors import InvalidArgumentError

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "parse_size"]

DEFAULT_MAX_SHARD_SIZE = "1GB"  # one default for the strategy, save_state_dict and the CLI

# Decimal units are powers of 1000, as Hugging Face's "5GB" means; binary units are spelled KiB/MiB/...
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(value: int | str, *, name: str = "max_shard_size") -> int:
    """``"5GB"`` -> 5_000_000_000, ``"1.5GiB"`` -> 1_610_612_736, ``1000`` -> 1000; a positive byte count."""
    hint = (
        f"{name}={value!r} is not a size: give a positive number of bytes or a number with a unit, "
        'e.g. 5000000, "5GB", "500MB", "1.5GiB" (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024)'
    )
    if isinstance(value, bool):
        raise InvalidArgumentError(hint)
    if isinstance(value, int):
        if value <= 0:
            raise InvalidArgumentError(hint)
        return value
    if not isinstance(value, str):
        raise InvalidArgumentError(hint)
    match = _SIZE_RE.fullmatch(value)
    if match is None or match.group(2).upper() not in _UNITS:
        raise InvalidArgumentError(hint)
    number, unit = match.groups()
    size = int(Decimal(number) * _UNITS[unit.upper()])  # Decimal: "1.1TB" is exactly 1_100_000_000_000
    if size <= 0:
        raise InvalidArgumentError(hint)
    return size
