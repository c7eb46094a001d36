"""After each kind of call the Trainer's ``optimizers`` and ``lr_scheduler_configs`` hold what stock (DDP, the same
script) holds: the user's optimizer over the module's parameters, the lr its scheduler left, the scheduler at its
step, and its state: each parameter's moments and step, bit for bit as DDP's on every rank (at 2 ranks of one host,
views into the kept state the ranks share per parameter: tests/test_shared_state.py; at one rank, views into the
kept partitions: tests/test_trainer_optimizer_state.py)."""

from __future__ import annotations

import json
import os

import pytest
from _launch import SCRIPTS, run_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(tmp_path, kind: str) -> tuple[dict[str, dict], dict[tuple[int, str], dict]]:
    """Rank 0's attributes after each call, and every rank's optimizer state per (rank, call)."""
    result = run_script(os.path.join(SCRIPTS, "trainer_attributes.py"), [kind, str(tmp_path / kind)], timeout=280,
                        cwd=str(tmp_path))
    lines = result.stdout.splitlines()
    attributes = {call: json.loads(text) for _, call, text in
                  (line.split(" ", 2) for line in lines if line.startswith("ATTRS "))}
    states = {(int(rank), call): json.loads(text) for _, rank, call, text in
              (line.split(" ", 3) for line in lines if line.startswith("STATE "))}
    return attributes, states


def test_after_each_call_the_optimizers_schedulers_and_state_are_stocks(tmp_path):
    (stagesafe, our_state), (stock, their_state) = _run(tmp_path, "stagesafe"), _run(tmp_path, "ddp")
    assert list(stagesafe) == list(stock) == ["fit", "test", "predict"]
    for call in stock:
        assert stock[call]["optimizers"][0]["with_state"] == 4  # AdamW holds its moments per parameter
        assert stagesafe[call] == stock[call], call
    assert sorted(our_state) == sorted(their_state) == [(r, c) for r in (0, 1) for c in ("fit", "predict", "test")]
    for seen, state in our_state.items():
        assert state == their_state[seen], seen  # keys, shapes and every value, on both ranks
        assert sorted(state) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
        assert state["net.0.weight"]["exp_avg"][0] == [16, 8] and state["net.0.weight"]["step"] == [[], [6.0]]
    fit = stagesafe["fit"]
    assert fit["optimizers"][0]["class"] == "AdamW"
    assert [g["lr"] for g in fit["optimizers"][0]["groups"]] == [1e-2 / 8, 1e-3 / 8]  # StepLR halved it 3 times
    assert [g["params"] for g in fit["optimizers"][0]["groups"]] == [["net.0.weight", "net.0.bias"],
                                                                     ["net.2.weight", "net.2.bias"]]
    assert fit["schedulers"] == [{"class": "StepLR", "interval": "step", "last_epoch": 6,
                                  "last_lr": [1e-2 / 8, 1e-3 / 8], "steps_listed": True}]
