"""Every on/off argument of the public API takes a real bool: text and numbers that merely convert to one are
refused before any work, whatever they would convert to."""

from __future__ import annotations

import pytest
import torch

from stagesafe.consolidate import consolidate, load_zero_checkpoint_with_client_state
from stagesafe.errors import InvalidArgumentError
from stagesafe.flags import checked_flag, checked_optional_flag
from stagesafe.handoff.read import load_state_dict
from stagesafe.publishing.save import save_state_dict
from stagesafe.publishing.verify import verify
from stagesafe.zero.checkpoint import open_zero_checkpoint

NOT_BOOLS = ["false", "False", "0", "no", "", "true", 0, 1, 0.0, [], b"0"]


@pytest.mark.parametrize("value", [*NOT_BOOLS, None])
def test_a_flag_is_true_or_false(value):
    with pytest.raises(InvalidArgumentError, match=r"^trust_pickles=.* must be True or False"):
        checked_flag("trust_pickles", value)
    assert checked_flag("x", True) is True and checked_flag("x", False) is False


@pytest.mark.parametrize("value", NOT_BOOLS)
def test_an_optional_flag_is_true_false_or_none(value):
    with pytest.raises(InvalidArgumentError, match=r"must be True, False or None \(the default\)"):
        checked_optional_flag("progress", value, default="the default")
    assert [checked_optional_flag("p", v, default="") for v in (True, False, None)] == [True, False, None]


@pytest.fixture
def handoff(tmp_path):
    url = str(tmp_path / "h")
    save_state_dict({"w": torch.ones(3)}, url)
    return url


@pytest.mark.parametrize("value", ["false", 0, 1])
def test_every_public_flag_refuses_what_is_not_a_bool(handoff, tmp_path, value):
    calls = {
        "verify": lambda: load_state_dict(handoff, verify=value),
        "progress": lambda: load_state_dict(handoff, progress=value),
        "fix_index": lambda: verify(handoff, fix_index=value),
        "overwrite": lambda: save_state_dict({"w": torch.ones(3)}, handoff, overwrite=value),
        "trust_pickles": lambda: load_zero_checkpoint_with_client_state(str(tmp_path), trust_pickles=value),
        "exclude_frozen": lambda: open_zero_checkpoint(str(tmp_path), exclude_frozen=value),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidArgumentError, match=f"^{name}={value!r} must be True"):
            call()
    with pytest.raises(InvalidArgumentError, match=f"^overwrite={value!r} must be True"):
        consolidate(str(tmp_path), str(tmp_path / "out"), overwrite=value)
    assert not (tmp_path / "out").exists()

