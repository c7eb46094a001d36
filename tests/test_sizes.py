"""handoff/sizes.py: sizes as users give them, parsed, and every bad one refused with the value named."""

from __future__ import annotations

import pytest
from _pure import PURE, imports_of

import stagesafe.handoff.sizes
from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size


def test_it_imports_neither_torch_nor_fsspec():
    assert imports_of(stagesafe.handoff.sizes) <= PURE


def test_the_default_is_a_size():
    assert parse_size(DEFAULT_MAX_SHARD_SIZE) == 1_000_000_000


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1),
        (123456, 123456),
        ("100", 100),
        ("100B", 100),
        ("5KB", 5_000),
        ("500MB", 500_000_000),
        ("5GB", 5_000_000_000),
        ("2TB", 2_000_000_000_000),
        ("5gb", 5_000_000_000),
        (" 5 GB ", 5_000_000_000),
        ("10KiB", 10_240),
        ("3MiB", 3 * 1024**2),
        ("1.5GiB", 1_610_612_736),
        ("0.5KB", 500),
        ("1.1TB", 1_100_000_000_000),
    ],
)
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["5XB", "", "GB", "-1GB", "1.2.3GB", "1e9", "0", 0, -5, True, 1.5, None, "0.1B"])
def test_parse_size_refuses_with_the_value_named(value):
    with pytest.raises(InvalidArgumentError, match="max_shard_size") as info:
        parse_size(value)
    assert repr(value) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_another_name_is_named_in_the_refusal():
    with pytest.raises(InvalidArgumentError, match="limit='x'"):
        parse_size("x", name="limit")
