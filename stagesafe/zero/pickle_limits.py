"""Bounds on what reading one pickle may cost, whatever it holds: memory and work in proportion to its size, and
dict keys whose hashes a file cannot make collide.

A pickle is a program, and a short one can ask for much: a 1-byte ``EMPTY_SET`` builds a 216-byte set, a 2-byte
memo read hands a million-item list to ``builtins.set`` once more, a 5-byte call copies a megabyte of bytes again.
The reader charges each opcode the memory it allocates (:data:`OPCODE_MEMORY`, near CPython's sizes) and each call
or ``BUILD`` the :func:`weight` of what it is given (a rule's work and allocation are at most that), from one
budget of :data:`MEMORY_PER_BYTE` times the pickle's size plus :data:`MEMORY_BASE`. A file ``torch.save`` wrote
spends a fraction of it; a crafted one is refused once it is spent, so reading it takes time and memory linear in
its size.

Python hashes an int to itself modulo 2**61 - 1, so a file can hold 200,000 distinct integer keys of one hash,
and a dict of them takes quadratic time to fill. Distinct ints below 2**61 - 1 hash apart, str and bytes hashes
are randomized per process, a stand-in hashes as its identity; :class:`HashSpread` counts, per container, the
other keys (large ints, floats, tuples, ...) that share a hash, and refuses more than :data:`MAX_SAME_HASH`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "MAX_SAME_HASH",
    "MEMORY_BASE",
    "MEMORY_PER_BYTE",
    "OPCODE_MEMORY",
    "MARK_LIST",
    "PER_ITEM",
    "RESULT",
    "SPARSE_SLOT",
    "HashSpread",
    "OverLimit",
    "weight",
]

# Bytes of memory the reading may allocate per byte of pickle, plus a fixed allowance. Measured (torch.save of
# 1.5 MB of DeepSpeed optimizer state, of 0.8 MB of ZeRO-1/2 model states, of Lightning hyperparameters): 10 to 13
# per byte charged, 7 to 10 allocated; a 10 MB run of EMPTY_SET opcodes is refused at 176 MiB.
MEMORY_PER_BYTE = 16
MEMORY_BASE = 16 * 2**20
MAX_SAME_HASH = 32  # keys of one dict or set that may share a hash, beyond the kinds that hash apart
RESULT = 160  # what one call may allocate, beyond the weight of its arguments (a tensor record: 104 bytes)
SPARSE_SLOT = 88  # a memo slot numbered out of order: a dict entry and its int key
MARK_LIST = 56  # the list a MARK starts, freed when the opcode that takes the items since the MARK pops it
PER_ITEM = {"list": 8, "tuple": 8, "dict": 64, "set": 64}  # added to a container, per item

# Bytes each opcode allocates, beyond the memory of the bytes it reads: the object it pushes and its stack slot
# (CPython 3.11, 64 bits). Those whose cost depends on their argument (strings, containers of n items) charge it
# themselves; a memo slot numbered in order is 8 bytes of a list (SPARSE_SLOT: out of order).
OPCODE_MEMORY = {
    b"\x8f": 224, b"}": 72, b"]": 64, b"(": 64, b")": 8, b"\x85": 56, b"\x86": 64, b"\x87": 72, b"2": 8,
    b"h": 8, b"j": 8, b"N": 8, b"\x88": 8, b"\x89": 8, b"K": 8, b"M": 36, b"J": 36, b"G": 32, b"\x8a": 44,
    b"\x8b": 44, b"r": 8, b"\x94": 8, b"c": 8, b"\x93": 8, b"Q": 8, b"R": RESULT, b"\x81": RESULT,
    b"\x92": RESULT, b"\x91": 224,
}  # fmt: skip

_HASH_APART = frozenset({str, bytes, bool, type(None)})
_IDENTITY_HASH = object.__hash__  # a stand-in's: distinct objects, distinct hashes
_SAFE_INT = 2**61 - 1  # ints of smaller magnitude hash to themselves (-1 to -2): distinct ints, distinct hashes


def weight(values: tuple) -> int:
    """An upper bound of the bytes a rule allocates, and the items it touches, when given ``values``: 8 per value,
    plus a string's or bytes' length, 8 per item of a tuple and 64 per item of another container (a rule may hash
    them into a set or copy them into a dict); and the same for the items of a tuple among ``values``, which a rule
    may copy too (a ``BUILD`` state ``(attributes, slots)`` is merged into one dict; a numpy array's state holds
    its bytes). Charged at every call or ``BUILD``, however often one memoized value is given again."""
    total = 8 * len(values)
    for value in values:
        total += _size(value)
        if isinstance(value, tuple):
            total += sum(_size(item) for item in value)
    return total


def _size(value: Any) -> int:
    kind = type(value)
    if kind is str or kind is bytes or kind is bytearray:
        return len(value)
    if isinstance(value, tuple):
        return 8 * len(value)
    if isinstance(value, (list, dict, set, frozenset)):
        return 64 * len(value)
    return 0


class OverLimit(Exception):
    """Reading a pickle would pass one of these bounds: said in the message."""


class HashSpread:
    """Keys that share a hash, counted per container (by its id): :meth:`check` refuses the one past
    :data:`MAX_SAME_HASH`. Keys of the kinds that hash apart are not counted."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], int] = {}

    def check(self, owner: object, key: Any) -> int:
        """Count ``key`` for the container ``owner``; returns the bytes that cost (0 or the count's entry)."""
        kind = type(key)
        if kind in _HASH_APART or (kind is int and -_SAFE_INT < key < _SAFE_INT) or kind.__hash__ is _IDENTITY_HASH:
            return 0
        slot = (id(owner), hash(key))
        seen = self._counts.get(slot, 0) + 1
        if seen > MAX_SAME_HASH:
            raise OverLimit(
                f"more than {MAX_SAME_HASH} keys of one dict or set share one hash (as {type(key).__name__} keys "
                "crafted to collide do, to make reading take quadratic time)"
            )
        self._counts[slot] = seen
        return 96 if seen == 1 else 0
