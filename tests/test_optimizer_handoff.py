"""A live engine's optimizer state read out per parameter (stagesafe/zero/engine/optimizer_out.py) and written as
the form beside a handoff (stagesafe/stages/optimizer_handoff.py), on one gloo rank with a real ZeRO-3 engine: the
tensors are DeepSpeed's own ``safe_get_full_optimizer_state`` bitwise, the JSON says what the optimizer holds, the
form verifies, and what cannot be written per parameter, or stored, is refused with nothing left behind."""

from __future__ import annotations

import os

import pytest
import torch
from _tensors import assert_bitwise_equal
from test_engine import TRAINED, _net, _step, build, deepspeed, process_group  # noqa: F401 - fixtures

from stagesafe.errors import CheckpointFormatError
from stagesafe.handoff.optimizer_state import open_form
from stagesafe.stages.history import HandoffTarget
from stagesafe.stages.optimizer_handoff import write_optimizer_handoff
from stagesafe.zero.engine.optimizer_out import StateGather, describe_optimizer

pytestmark = pytest.mark.timeout(300)


def _stepped(build, steps: int = 2):
    model = _net()
    engine = build(model)
    for _ in range(steps):
        _step(engine)
    return model, engine


def _deepspeeds(model) -> dict[str, torch.Tensor]:
    """``exp_avg/<name>`` and ``exp_avg_sq/<name>`` of every trained parameter, by DeepSpeed's own gather."""
    from deepspeed.utils import safe_get_full_optimizer_state

    params = dict(model.named_parameters())
    return {f"{key}/{name}": safe_get_full_optimizer_state(params[name], key).detach().clone()
            for name in TRAINED for key in ("exp_avg", "exp_avg_sq")}


def test_the_state_gathered_per_parameter_is_deepspeeds_bitwise(build):
    model, engine = _stepped(build)
    described = describe_optimizer(engine)
    assert described.keys == ["exp_avg", "exp_avg_sq"]
    assert [name for name, _, _ in described.trained] == TRAINED  # the tied head.weight once, the frozen layer not
    assert described.values == [{"step": {"dtype": "float32", "value": 2.0}}]
    assert described.hyperparameters[0]["lr"] == 0.1 and described.hyperparameters[0]["betas"] == [0.9, 0.999]
    gather = StateGather(engine, described)
    names = [(key, name) for name in TRAINED for key in described.keys]
    got = {f"{key}/{name}": tensor for (key, name), tensor in gather.bucket(names).items()}
    assert_bitwise_equal(dict(sorted(got.items())), dict(sorted(_deepspeeds(model).items())))


def test_the_form_written_from_an_engine_verifies_and_holds_its_state(build, tmp_path):
    from stagesafe.cli import main

    model, engine = _stepped(build)
    url = str(tmp_path / "handoff")
    bound = write_optimizer_handoff(engine, HandoffTarget(url), 200, source={"stage": "fit"})
    assert sorted(os.listdir(url)) == [bound["folder"]]  # the state alone: the weights come next, naming it
    from deepspeed.utils import safe_get_full_fp32_param

    from stagesafe import load_state_dict, save_state_dict

    weights = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in model.named_parameters() if n in TRAINED}
    save_state_dict(weights, url, overwrite=True, metadata={"optimizer": bound})
    assert main(["verify", "-q", url]) == 0
    form = open_form(url)
    assert len(form.manifest["shards"]) > 1  # several shards of at most 200 bytes: gathered one at a time
    assert form.groups[0].params == tuple(TRAINED) and form.source == {"stage": "fit"}
    assert_bitwise_equal(dict(sorted(load_state_dict(form.url).items())), dict(sorted(_deepspeeds(model).items())))


class _Preconditioned(torch.optim.SGD):
    """SGD that also keeps a small matrix per parameter: state that is not one value per element."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("preconditioner", torch.zeros(2, 2))
        return super().step(closure)


def test_state_that_is_not_per_parameter_is_refused_naming_it_and_nothing_is_written(process_group, tmp_path):
    model = _net()
    trainable = [p for p in model.parameters() if p.requires_grad]
    from test_engine import CONFIG

    engine, *_ = deepspeed.initialize(model=model, optimizer=_Preconditioned(trainable, lr=0.1), config=dict(CONFIG))
    try:
        _step(engine)
        url = str(tmp_path / "handoff")
        with pytest.raises(CheckpointFormatError, match=r"'preconditioner' \(_Preconditioned\) is a tensor of shape "
                                                        r"\[2, 2\], neither one value per element"):
            write_optimizer_handoff(engine, HandoffTarget(url), 10**9, source={})
        assert not os.path.exists(url)
    finally:
        engine.destroy()


def test_a_store_that_fails_leaves_no_state_and_says_why(build, tmp_path):
    _, engine = _stepped(build, steps=1)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with pytest.raises(OSError):
        write_optimizer_handoff(engine, HandoffTarget(str(blocked)), 10**9, source={})
    assert blocked.read_text() == "not a folder" and os.listdir(tmp_path) == ["a-file"]


def test_a_state_whose_weights_were_not_committed_is_deleted(build, tmp_path):
    """What a failed weights' write calls on every rank: rank 0 deletes the state written for them."""
    from stagesafe.stages.optimizer_handoff import forget_optimizer_handoff

    _, engine = _stepped(build, steps=1)
    target = HandoffTarget(str(tmp_path / "handoff"))
    bound = write_optimizer_handoff(engine, target, 10**9, source={})
    assert os.listdir(target.uri) == [bound["folder"]]
    forget_optimizer_handoff(target, bound["folder"])
    assert os.listdir(target.uri) == []
