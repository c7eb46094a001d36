"""Paths and names at the API's edges (issue 39): each one a typed error of the project that says what to do,
never a raw ``OSError`` or ``ValueError`` from the operating system, and nothing a terminal acts on in the CLI's
output."""

from __future__ import annotations

import os

import pytest
import torch
from _hostile import forge_manifest

from stagesafe.cli import main
from stagesafe.errors import HandoffCorruptError, InvalidArgumentError
from stagesafe.handoff.read import load_state_dict
from stagesafe.publishing.save import save_state_dict
from stagesafe.publishing.verify import verify

LONG_SHARD = "model-00001-of-" + "0" * 270 + "1.safetensors"  # 300 characters: longer than a file name can be


@pytest.fixture
def handoff(tmp_path):
    url = str(tmp_path / "h")
    save_state_dict({"w": torch.ones(3)}, url)
    return url


def _rename_shard(manifest: dict) -> None:
    (old,) = manifest["shards"]
    manifest["shards"][LONG_SHARD] = manifest["shards"].pop(old)
    manifest["weight_map"] = {name: LONG_SHARD for name in manifest["weight_map"]}


@pytest.mark.parametrize("reader", [load_state_dict, verify])
def test_a_manifest_naming_a_shard_too_long_for_a_file_is_a_corrupt_handoff(handoff, reader):
    forge_manifest(handoff, _rename_shard)
    with pytest.raises(HandoffCorruptError, match="is not a shard file name of this format"):
        reader(handoff)


@pytest.mark.parametrize(
    "call",
    [
        lambda url: load_state_dict(url + "\0x"),
        lambda url: verify(url + "\0x"),
        lambda url: save_state_dict({"w": torch.ones(1)}, url + "\0x"),
    ],
)
def test_a_nul_in_a_path_is_an_invalid_argument(handoff, call):
    with pytest.raises(InvalidArgumentError, match=r"holds a NUL character"):
        call(handoff)


def test_a_handoff_destination_that_is_a_file_says_so(tmp_path):
    target = tmp_path / "weights.safetensors"
    target.write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match=r"uri=.*weights.safetensors' is a file, not a folder"):
        save_state_dict({"w": torch.ones(1)}, str(target))
    assert target.read_bytes() == b"x"


def test_a_strategys_handoff_uri_that_is_a_file_says_so_when_made(tmp_path):
    from stagesafe.strategy import StageSafeDeepSpeedStrategy

    target = tmp_path / "file"
    target.write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match=r"handoff_uri=.*file' is a file, not a folder"):
        StageSafeDeepSpeedStrategy(handoff_uri=str(target))


ESC = "\x1b[31mred"


@pytest.mark.parametrize("args", [["verify"], ["verify", "--fix-index"], ["inspect"]])
def test_the_cli_escapes_control_characters_of_a_path(tmp_path, capsys, args):
    url = str(tmp_path / f"a{ESC}")
    save_state_dict({"w": torch.ones(3)}, url)
    assert main([*args, url]) == 0
    assert main([*args, url + "-missing"]) != 0
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\\x1b[31mred" in out and "\\x1b[31mred" in err


def test_a_nul_in_a_cli_path_is_exit_2(capsys, tmp_path):
    assert main(["verify", str(tmp_path) + "\0x"]) == 2
    assert "holds a NUL character" in capsys.readouterr().err
