"""After each kind of call the Trainer's ``optimizers`` and ``lr_scheduler_configs`` hold what stock (DDP, the same
script) holds: the user's optimizer over the module's parameters, the lr its scheduler left, the scheduler at its
step. One difference at two ranks, on purpose: the optimizer's state (Adam's moments) is not in
``optimizer.state`` but kept beside the module, partitioned over the ranks as the engine held it
(``trainer.save_checkpoint`` writes it): holding it per parameter on every rank would be a second, whole copy.
At one rank it is there, as views into the kept state: tests/test_trainer_optimizer_state.py."""

from __future__ import annotations

import json
import os

import pytest
from _launch import SCRIPTS, run_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _attributes(tmp_path, kind: str) -> dict[str, dict]:
    result = run_script(os.path.join(SCRIPTS, "trainer_attributes.py"), [kind, str(tmp_path / kind)], timeout=280,
                        cwd=str(tmp_path))
    lines = [line.split(" ", 2) for line in result.stdout.splitlines() if line.startswith("ATTRS ")]
    return {call: json.loads(text) for _, call, text in lines}


def test_after_each_call_the_optimizers_and_schedulers_are_stocks_but_the_state(tmp_path):
    stagesafe, stock = _attributes(tmp_path, "stagesafe"), _attributes(tmp_path, "ddp")
    assert list(stagesafe) == list(stock) == ["fit", "test", "predict"]
    for call in stock:
        ours, theirs = stagesafe[call], stock[call]
        assert theirs["optimizers"][0]["with_state"] == 4  # stock's AdamW holds its moments per parameter
        assert ours["optimizers"][0].pop("with_state") == 0  # stagesafe keeps them beside the module, partitioned
        theirs["optimizers"][0].pop("with_state")
        assert ours == theirs, call
    fit = stagesafe["fit"]
    assert fit["optimizers"][0]["class"] == "AdamW"
    assert [g["lr"] for g in fit["optimizers"][0]["groups"]] == [1e-2 / 8, 1e-3 / 8]  # StepLR halved it 3 times
    assert [g["params"] for g in fit["optimizers"][0]["groups"]] == [["net.0.weight", "net.0.bias"],
                                                                     ["net.2.weight", "net.2.bias"]]
    assert fit["schedulers"] == [{"class": "StepLR", "interval": "step", "last_epoch": 6,
                                  "last_lr": [1e-2 / 8, 1e-3 / 8], "steps_listed": True}]
