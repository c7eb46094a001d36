"""storage/temp_names.py: the temporary name a file is written under, and the shape a cleanup recognises."""

from __future__ import annotations

import ast
import pathlib
import re

import stagesafe.storage.temp_names
from stagesafe.storage.temp_names import TEMP_SUFFIX, temp_name


def test_a_temp_name_is_the_name_and_a_hex_token_that_the_suffix_matches():
    assert temp_name("a.bin", "00ff") == "a.bin.tmp-00ff"
    drawn = {temp_name("a.bin") for _ in range(16)}
    assert len(drawn) == 16  # a fresh token each time: two writers never share a temporary file
    for name in drawn:
        assert re.fullmatch(re.escape("a.bin") + TEMP_SUFFIX, name)
    assert not re.fullmatch(re.escape("a.bin") + TEMP_SUFFIX, "a.bin.tmp-xyz")  # not hex: not ours
    assert not re.fullmatch(re.escape("a.bin") + TEMP_SUFFIX, "a.bin")


def test_it_is_pure():
    tree = ast.parse(pathlib.Path(stagesafe.storage.temp_names.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported == {"__future__", "secrets"}
