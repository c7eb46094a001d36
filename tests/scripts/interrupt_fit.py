"""Ctrl+C in a single-process Lightning run (``devices=1``, Lightning's own launcher), as in a notebook.

Usage: python interrupt_fit.py ROOT OUT.json

``training_step`` sends the process SIGINT at global step 2, so Python raises KeyboardInterrupt there.
Lightning then tears the strategy down and calls ``sys.exit(1)``; the script catches that ``SystemExit`` and
records the module. Then the same Trainer runs ``test``, which itself gets SIGINT at its second batch, and a
last ``fit`` runs on a new Trainer. A reference module goes through ``fit(max_steps=2)`` for the bitwise
comparison. Every record holds the module's probe (``toy.probe``), the handoff's digest and the error.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl
import torch
from toy import ToyModule, dataloader, probe, quiet_trainer, state_digest_of

from stagesafe import StageSafeDeepSpeedStrategy, load_state_dict
from stagesafe.stages.stage_entry import assert_clean

INTERRUPT_AT = 2


def ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)  # the signal cuts this short with KeyboardInterrupt
    raise AssertionError("SIGINT did not interrupt the step")


class Interrupted(ToyModule):
    interrupt_train_at: int | None = None
    interrupt_test_at: int | None = None

    def training_step(self, batch, batch_idx):
        if self.global_step == self.interrupt_train_at:
            ctrl_c()
        return super().training_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        if batch_idx == self.interrupt_test_at:
            ctrl_c()
        return super().test_step(batch, batch_idx)


def trainer(root: str, name: str, max_steps: int = -1) -> pl.Trainer:
    return quiet_trainer(root, name, devices=1, max_steps=max_steps)


def fresh() -> Interrupted:
    torch.manual_seed(0)
    return Interrupted()


def record(stages: list, label: str, module: Interrupted, handoff: str, call, trainer: pl.Trainer) -> None:
    rec: dict = {"stage": label, "error": None}
    try:
        call()
        trainer.strategy.wait_for_handoff()  # the call returned before its handoff was committed
    except BaseException as exc:  # noqa: BLE001 - SystemExit from Lightning's KeyboardInterrupt handling
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc()[-3000:]
    rec["probe"] = probe(module)
    try:
        assert_clean(module)
        rec["stale"] = None
    except Exception as exc:  # noqa: BLE001
        rec["stale"] = str(exc)
    rec["handoff_digest"] = state_digest_of(load_state_dict(handoff))
    stages.append(rec)


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    result: dict = {}
    reference = fresh()
    t = trainer(root, "reference", max_steps=INTERRUPT_AT)
    result["reference"] = []
    record(result["reference"], "fit", reference, f"{root}/reference/handoff", lambda: t.fit(reference, dataloader()), t)

    module = fresh()
    module.interrupt_train_at = INTERRUPT_AT
    handoff = f"{root}/interrupted/handoff"
    stages: list = []
    t = trainer(root, "interrupted")
    record(stages, "fit", module, handoff, lambda: t.fit(module, dataloader()), t)
    stages[-1]["global_step"] = t.global_step
    module.interrupt_train_at = None
    module.interrupt_test_at = 1
    record(stages, "test", module, handoff, lambda: t.test(module, dataloader(), verbose=False), t)
    module.interrupt_test_at = None
    record(stages, "test", module, handoff, lambda: t.test(module, dataloader(), verbose=False), t)
    t2 = trainer(root, "interrupted")
    record(stages, "fit", module, handoff, lambda: t2.fit(module, dataloader()), t2)
    result["interrupted"] = stages
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
