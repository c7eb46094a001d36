"""One rank of one job of a 2-rank sequence of jobs on one folder (started by run_ranks, each job a new process).

Usage: python ownership.py JOB ROOT [HANDOFF_URI]
  fit          a fresh module fits (4 steps) and waits for its handoff; the default folder unless HANDOFF_URI.
  bad_ckpt     a fresh module: test with a ckpt_path that does not exist (it raises FileNotFoundError).
  test         a fresh module: test, no ckpt_path.
  resume       fit resuming from HANDOFF_URI, writing to it.
  overwrite    fit to HANDOFF_URI with overwrite_handoff=True.
Each rank prints ``RECORD {json}``: the call's error (type, message), and the folder its strategy wrote.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from faults import _leave_at_once  # noqa: E402
from toy import ToyModule, dataloader  # noqa: E402

import stagesafe  # noqa: E402

RANK = int(os.environ["RANK"])


def main() -> None:
    job, root = sys.argv[1], sys.argv[2]
    named = sys.argv[3] if len(sys.argv) > 3 else None
    torch.manual_seed(0)
    module = ToyModule()
    kwargs: dict = {"handoff_uri": named}
    if job == "resume":
        kwargs["resume_from"] = named
    if job == "overwrite":
        kwargs["overwrite_handoff"] = True
    strategy = stagesafe.StageSafeDeepSpeedStrategy(stage=3, timeout=datetime.timedelta(seconds=30), **kwargs)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )
    rec: dict = {"job": job, "error": None}
    try:
        if job in ("fit", "resume", "overwrite"):
            trainer.fit(module, train_dataloaders=dataloader())
        elif job == "bad_ckpt":
            trainer.test(module, dataloaders=dataloader(), ckpt_path=os.path.join(root, "no-such-checkpoint"),
                         verbose=False)
        else:
            trainer.test(module, dataloaders=dataloader(), verbose=False)
        strategy.wait_for_handoff()
    except Exception as exc:  # noqa: BLE001 - what the user sees
        rec["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000],
                        "mro": [c.__name__ for c in type(exc).__mro__]}
    try:
        strategy.wait_for_handoff()
    except Exception:  # noqa: BLE001 - already recorded
        pass
    report = strategy.last_boundary
    rec["uri"] = report.uri if report is not None else None
    rec["global_step"] = int(trainer.global_step)
    print("RECORD " + json.dumps(rec), flush=True)
    _leave_at_once()  # the handoff is joined; gloo may abort tearing down the group of a call refused at entry


if __name__ == "__main__":
    main()
