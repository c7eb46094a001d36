"""Nothing the engine held is lost at a boundary: fp32 masters of every layer, and the optimizer state.

2 CPU ranks, bf16-mixed, AdamW with weight decay and a step-wise lr schedule (tests/scripts/engine_state.py):
ZeRO-3 with layers built in ``__init__`` and in ``configure_model`` (under ``zero.Init``, in bf16), with
``between_stages`` cpu and meta, and ZeRO-2. Two processes: the first trains and saves, the second resumes
from the saved folder, under stagesafe and under stock Lightning. Every comparison is bitwise.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from _launch import SCRIPTS, run_script

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

CONFIGS = (
    "z3-init-cpu",
    "z3-init-meta",
    "z3-configure_model-cpu",
    "z3-configure_model-meta",
    "z2-init-cpu",
    "z2-configure_model-cpu",
)
SCRIPT = os.path.join(SCRIPTS, "engine_state.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("engine-state"))
    run_script(SCRIPT, ["first", out, *CONFIGS], timeout=800, cwd=out)
    run_script(SCRIPT, ["resume", out, *CONFIGS], timeout=400, cwd=out)
    return out


def _load(runs: str, config: str, name: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(runs, config, f"{name}.safetensors"))


def _assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], names=None) -> None:
    names = sorted(expected) if names is None else names
    assert set(names) <= set(actual), sorted(set(names) - set(actual))
    for name in names:
        a, e = actual[name], expected[name]
        assert a.dtype == e.dtype and a.shape == e.shape, (name, a.dtype, e.dtype, a.shape, e.shape)
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8)), f"{name} differs"


def _parameters(values: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n in values if not n.endswith("scale"))  # the toy model's one buffer


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("trainer", ["new", "same"])
def test_a_fit_at_lr_zero_after_a_fit_hands_off_the_same_fp32_masters(runs, config, trainer):
    """fit -> H1; fit at lr 0 -> H2 == H1 bitwise, fp32 for every parameter, though configure_model's layers
    are held in bf16 by the module between the calls."""
    h1, h2 = _load(runs, config, f"a-{trainer}-h1"), _load(runs, config, f"a-{trainer}-h2")
    assert {str(h1[n].dtype) for n in _parameters(h1)} == {"torch.float32"}
    _assert_bitwise(h2, h1)
    with open(os.path.join(runs, config, f"a-{trainer}-h1.module-dtypes.json")) as f:
        module_dtypes = set(json.load(f).values())
    built_in_bf16 = config.startswith("z3-configure_model")  # zero.Init builds them in the precision's dtype
    assert module_dtypes == {"torch.bfloat16" if built_in_bf16 else "torch.float32"}


@pytest.mark.parametrize("config", CONFIGS)
def test_fit_save_checkpoint_and_resume_in_a_new_process_equals_one_uninterrupted_fit(runs, config):
    """fit(2 epochs) == fit(1 epoch) -> save_checkpoint -> new process, new Trainer, fit(ckpt_path, 2 epochs):
    Adam's moments, its step count and the lr schedule all crossed the boundary."""
    straight, resumed = _load(runs, config, "straight"), _load(runs, config, "resumed")
    _assert_bitwise(resumed, straight)
    assert not _differs_nowhere(straight, _load(runs, config, "first-epoch"))  # the second epoch did train
    with open(os.path.join(runs, config, "save-warnings.json")) as f:
        assert json.load(f) == []  # nothing is missing from the checkpoint
    with open(os.path.join(runs, config, "resume-warnings.json")) as f:
        assert not [w for w in json.load(f) if "optimizer" in w]


@pytest.mark.parametrize("config", CONFIGS)
def test_stock_lightning_resumes_from_the_same_folder_to_the_same_weights(runs, config):
    """The folder is DeepSpeed's own: stock Lightning (the CPU-enabled base class) resumes from it and ends
    with fp32 masters equal to the uninterrupted fit's."""
    straight, stock = _load(runs, config, "straight"), _load(runs, config, "stock")
    _assert_bitwise(stock, straight, _parameters(straight))


@pytest.mark.parametrize("config", ["z3-configure_model-cpu", "z2-init-cpu"])
def test_the_saved_folder_is_read_by_deepspeeds_converter_and_stagesafe_consolidate(runs, config, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from stagesafe import load_state_dict
    from stagesafe.cli import main

    folder = os.path.join(runs, config, "ckpt")
    first_epoch = _load(runs, config, "first-epoch")
    names = _parameters(first_epoch)
    converted = {n: t.contiguous() for n, t in get_fp32_state_dict_from_zero_checkpoint(folder).items()}
    _assert_bitwise(converted, first_epoch, names)
    assert main(["consolidate", folder, str(tmp_path / "ours"), "-q"]) == 0
    _assert_bitwise(load_state_dict(str(tmp_path / "ours")), first_epoch, names)
    assert not os.path.exists(os.path.join(folder, "stagesafe_weights_only.json"))


def test_a_checkpoint_that_cannot_hold_the_optimizer_state_says_so_when_saved(runs):
    config = CONFIGS[0]
    with open(os.path.join(runs, config, "not-kept-warnings.json")) as f:
        not_kept = json.load(f)
    assert len(not_kept) == 1 and "no optimizer state" in not_kept[0] and "keep_optimizer_state=False" in not_kept[0]
    with open(os.path.join(runs, config, "changed-warnings.json")) as f:
        changed = json.load(f)
    assert len(changed) == 1 and "changed since the last fit ended" in changed[0]
    for name in ("ckpt-not-kept", "ckpt-changed"):
        assert os.path.exists(os.path.join(runs, config, name, "stagesafe_weights_only.json"))


def _differs_nowhere(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)
