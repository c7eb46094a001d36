"""_shown.py: how a value from a file appears in an error message: clipped, escaped, on one line, a few levels and
items deep from one budget of characters, and never an error of its own.

(Values crafted to make a rendering exponential, and a container's items touched, are in tests/test_pickle_limits.py;
a numpy array's repr of several lines, in tests/test_pickle_reader.py.)
"""

from __future__ import annotations

from collections import OrderedDict

import pytest

from stagesafe._shown import clip, shown


def test_clip_keeps_short_text_and_says_how_long_a_cut_one_was():
    assert clip("x" * 120) == "x" * 120
    assert clip("x" * 121) == "x" * 104 + "... (121 chars)"
    assert clip("abcdefghijklmnopqrstuvwxyz", 10) == "abcdefgh... (26 chars)"  # never fewer than 8 kept


def test_a_value_within_its_limit_is_its_repr():
    value = {"a": 1, "b": (2,), "c": [None, 1.5], "d": frozenset({3}), "e": {4}, "f": (), "g": b"\x00"}
    assert shown(value) == repr(value)
    assert shown(OrderedDict(x=1)) == "OrderedDict({'x': 1})"  # a dict of another class says which


def test_control_characters_are_escaped_and_a_repr_of_several_lines_is_one():
    class Table:
        def __repr__(self) -> str:
            return "Table(\n    rows=2,\n\tcols=3)"

    assert shown("name\x1b[2J\x07\r\nhidden") == r"'name\x1b[2J\x07\r\nhidden'"
    assert shown(Table()) == "Table( rows=2, cols=3)"


def test_containers_are_shown_four_levels_and_twenty_items_deep():
    assert shown([[[[[[1]]]]]]) == "[[[[[...]]]]]"
    assert shown({"k": {"k": {"k": {"k": {"k": 1}}}}}) == "{'k': {'k': {'k': {'k': {...}}}}}"
    assert shown(list(range(30)), 1000) == repr(list(range(20)))[:-1] + ", ...]"


def test_one_budget_is_shared_by_the_whole_value():
    """The first long string spends the budget: the second is not rendered at all."""
    text = shown(["a" * 10**6, "b" * 10**6])
    assert "b" not in text and text.startswith("['aaaa") and len(text) <= 120
    cut = shown("x" * 1000, 40)
    assert cut.startswith("'" + "x" * 23 + "... (") and len(cut) <= 40  # cut as it is rendered, then clipped


def test_a_part_that_cannot_be_shown_is_named_by_its_type():
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    class Refusing:
        def __shown__(self):
            raise ValueError("no parts")

    assert shown([Broken(), 1]) == "[<a Broken that cannot be shown>, 1]"
    assert shown({"n": 10**5000}) == "{'n': <a int that cannot be shown>}"  # past Python's digit limit
    assert shown(Refusing()) == "<a Refusing that cannot be shown>"


def test_a_value_that_shows_itself_is_rendered_from_its_parts_within_the_budget():
    class Record:
        def __init__(self, **fields) -> None:
            self.fields = fields

        def __shown__(self):
            return "<Record ", self.fields.items(), ">", True

    assert shown(Record(a=1, b=[2])) == "<Record 'a': 1, 'b': [2]>"
    nested = Record(inner=Record(inner=Record(inner=Record(inner=Record()))))
    assert shown(nested) == "<Record 'inner': <Record 'inner': <Record 'inner': <Record 'inner': <Record ...>>>>>"
    assert len(shown(Record(**{f"f{i}": "x" * 1000 for i in range(100)}))) <= 120


@pytest.mark.parametrize("limit", [20, 120, 1000])
def test_a_shown_value_is_never_much_longer_than_its_limit(limit):
    wide = {f"key{i}": [list(range(50))] * 50 for i in range(50)}
    assert len(shown(wide, limit)) <= max(limit, 24)
