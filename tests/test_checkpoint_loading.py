"""stages/checkpoint_loading.py: a checkpoint folder read at a call's start, on a real 1-rank ZeRO-3 engine in
the test process. A checkpoint DeepSpeed wrote during a fit is loaded into another engine bit for bit (masters,
moments), with its client state; its fp32 weights are read without an engine; a state dict that does not fit
the module is refused before anything is loaded (with ``strict``)."""

from __future__ import annotations

import pytest
import torch
from test_engine import build, process_group  # noqa: F401 - fixtures
from torch import nn

from stagesafe.errors import StateDictMismatchError
from stagesafe.stages.checkpoint_loading import check_keys, load_training_checkpoint, read_weights_checkpoint

pytestmark = pytest.mark.timeout(300)

deepspeed = pytest.importorskip("deepspeed")


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _trained(build, seed: int):  # noqa: F811 - the fixture imported above
    engine = build(_net(seed))
    x = torch.randn(3, 8)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return engine


def _masters(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {
        **{n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()},
        **{f"{n}/exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone()
           for n, p in engine.module.named_parameters()},
    }


def test_a_checkpoint_written_during_a_fit_goes_into_another_engine_bit_for_bit(build, tmp_path):  # noqa: F811
    folder = str(tmp_path / "ckpt")
    writer = _trained(build, 1)
    writer.save_checkpoint(folder, client_state={"loops": {"epoch": 3}})
    expected = _masters(writer)
    reader = _trained(build, 2)
    client = load_training_checkpoint(reader, folder, strict=True)
    assert client["loops"] == {"epoch": 3}
    got = _masters(reader)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name].view(torch.int32), expected[name].view(torch.int32)), name


def test_its_weights_are_read_without_an_engine_with_the_client_state(build, tmp_path):  # noqa: F811
    folder = str(tmp_path / "ckpt")
    writer = _trained(build, 3)
    writer.save_checkpoint(folder, client_state={"hello": 1})
    expected = {n: m for n, m in _masters(writer).items() if "/" not in n}
    client = read_weights_checkpoint(folder)
    assert client["hello"] == 1
    assert client["state_dict"].keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(client["state_dict"][name], value), name


def test_a_state_dict_that_does_not_fit_the_module_is_refused_only_when_strict():
    module = _net(4)
    fits = {k: v.clone() for k, v in module.state_dict().items()}
    check_keys(module, fits, True)
    wrong = {**fits, "2.weight": torch.zeros(5, 16)}
    with pytest.raises(StateDictMismatchError):
        check_keys(module, wrong, True)
    missing = {k: v for k, v in fits.items() if k != "0.bias"}
    with pytest.raises(StateDictMismatchError):
        check_keys(module, missing, True)
    check_keys(module, wrong, False)
    check_keys(None, wrong, True)
