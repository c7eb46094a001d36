"""consolidate_optimizer.py: a DeepSpeed checkpoint's optimizer state (a real 1-rank ZeRO-3 engine's) written
per parameter beside its consolidated weights, committed as a handoff of its own that the weights bind."""

from __future__ import annotations

import pytest
from _engine_nets import consolidated_with_optimizer
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.handoff.optimizer_state import open_form
from stagesafe.handoff.read import load_state_dict

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


def test_the_moments_are_written_per_parameter_and_bound_to_the_weights(build, tmp_path):  # noqa: F811
    from deepspeed.utils import safe_get_full_optimizer_state

    model, dst = consolidated_with_optimizer(build, tmp_path)
    form = open_form(dst)
    assert form is not None and form.keys == ("exp_avg", "exp_avg_sq")
    assert set(form.group_of()) == {name for name, _ in model.named_parameters()}
    state = load_state_dict(form.url)
    for name, p in model.named_parameters():
        for key in form.keys:
            assert (state[f"{key}/{name}"] == safe_get_full_optimizer_state(p, key)).all(), (key, name)
