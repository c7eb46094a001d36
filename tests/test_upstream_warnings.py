"""The upstream warnings printed at every step are left out, narrowly, and come back with the documented switch."""

from __future__ import annotations

import collections
import os
import warnings

import pytest
from _launch import run_script

from stagesafe.upstream_warnings import SHOW_VARIABLE, quiet_per_step_warnings

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 16  # tests/scripts/plain_user.py's max_steps
DEPRECATED = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `all_gather_single` instead."


def _shown(message: str, module: str, category: type[Warning] = FutureWarning) -> bool:
    """Whether a warning of ``message`` raised in ``module`` passes this process's filters."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # not pytest's filters: only this module's
        quiet_per_step_warnings()
        warnings.warn_explicit(message, category, filename=f"{module}.py", lineno=1, module=module, registry={})
    return bool(caught)


def test_only_the_per_step_messages_of_torch_and_deepspeed_are_left_out(monkeypatch):
    monkeypatch.delenv(SHOW_VARIABLE, raising=False)
    reduce = DEPRECATED.replace("all_gather_into_tensor", "reduce_scatter_tensor")
    assert not _shown(DEPRECATED, "torch.distributed.c10d_logger")
    assert not _shown(reduce, "torch.distributed.distributed_c10d")
    assert not _shown(DEPRECATED, "deepspeed.comm.torch")
    assert _shown(DEPRECATED, "my_training_script")  # the user's own call is the user's to fix
    assert _shown("`torch.distributed.reduce_op` is deprecated", "torch.distributed.distributed_c10d")
    assert _shown(DEPRECATED, "torch.distributed.c10d_logger", category=DeprecationWarning)


def test_the_switch_shows_them(monkeypatch):
    monkeypatch.setenv(SHOW_VARIABLE, "1")
    assert _shown(DEPRECATED, "torch.distributed.c10d_logger")


def _stderr_of_plain_script(tmp_path, name: str, env: dict[str, str | None]) -> list[str]:
    script = os.path.join(HERE, "scripts", "plain_user.py")
    result = run_script(script, [str(tmp_path / name)], timeout=300, env=env, cwd=str(tmp_path))
    return result.stderr.splitlines()


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_a_plain_user_script_prints_no_line_per_step_and_the_switch_brings_them_back(tmp_path):
    """A user's own script (no warning filters, Lightning's launcher starting rank 1): fit for 16 steps, then
    test, on 2 CPU ranks. No line of its stderr comes once per step; with the switch the pair comes back."""
    quiet = _stderr_of_plain_script(tmp_path, "quiet", {SHOW_VARIABLE: None, "PYTHONWARNINGS": None})
    counts = collections.Counter(quiet)
    assert max(counts.values()) < STEPS, counts.most_common(3)
    assert not [line for line in quiet if "` is deprecated. Please use `torch.distributed." in line]
    assert not [line for line in quiet if "return func(*args, **kwargs)" in line]
    assert any("handoff committed" in line for line in quiet)  # stagesafe's own line and Lightning's stay
    assert any("`Trainer.fit` stopped: `max_steps=16` reached." in line for line in quiet)

    loud = _stderr_of_plain_script(tmp_path, "loud", {SHOW_VARIABLE: "1", "PYTHONWARNINGS": None})
    gathers = [line for line in loud if "`torch.distributed.all_gather_into_tensor` is deprecated" in line]
    scatters = [line for line in loud if "`torch.distributed.reduce_scatter_tensor` is deprecated" in line]
    assert len(gathers) >= STEPS and len(scatters) >= STEPS, collections.Counter(loud).most_common(3)
