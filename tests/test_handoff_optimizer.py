"""zero/handoff_optimizer.py: the optimizer state beside a handoff read as a checkpoint's optimizer is: its keys,
param groups and one-value state, and the elements asked for of each parameter's state and master."""

from __future__ import annotations

import pytest
import torch
from _engine_nets import consolidated_with_optimizer
from test_engine import build, process_group  # noqa: F401 - fixtures

from stagesafe.handoff.optimizer_state import open_form
from stagesafe.zero.handoff_optimizer import HandoffOptimizer

pytestmark = pytest.mark.timeout(300)
deepspeed = pytest.importorskip("deepspeed")


def test_the_state_is_read_per_parameter_element_by_element(build, tmp_path):  # noqa: F811
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    model, dst = consolidated_with_optimizer(build, tmp_path)
    source = HandoffOptimizer(open_form(dst), dst)
    assert source.element_keys == ["exp_avg", "exp_avg_sq"] and source.master_dtype == "float32"
    assert source.param_group_of("0.weight") == 0 and source.partition_of_group(0) == 0
    assert int(source.values(0)["step"]) == 1
    weight = model[0].weight
    moment, master = torch.empty(5), torch.empty(5)
    source.read_all([("0.weight", "exp_avg", 3, moment), ("0.weight", None, 3, master)])
    assert torch.equal(moment, safe_get_full_optimizer_state(weight, "exp_avg").reshape(-1)[3:8])
    assert torch.equal(master, safe_get_full_fp32_param(weight).reshape(-1)[3:8])
