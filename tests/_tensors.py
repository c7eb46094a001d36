"""Comparing tensors as the tests need to: bit for bit (NaN payloads and -0.0 included), names in order."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["bits", "assert_bitwise_equal", "Unwritable"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so NaN payloads and -0.0 compare exactly."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(bits(got), bits(want)), name


class Unwritable(torch.Tensor):
    """A tensor whose bytes cannot be read for writing: a real failure inside the shard writer."""

    @staticmethod
    def __new__(cls, base):
        return torch.Tensor._make_subclass(cls, base)

    def contiguous(self, *args, **kwargs):
        raise RuntimeError("this tensor cannot be written")
