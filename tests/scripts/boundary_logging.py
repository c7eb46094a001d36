"""validate then fit on 2 CPU ranks, with Python logging sent to one file per rank.

Usage: python boundary_logging.py OUT_DIR
Lightning starts rank 1 by re-running this command line. Each process configures logging before anything
else runs, the way an application would, and writes OUT_DIR/rank<r>.log; the handoff goes to OUT_DIR/handoff.
"""

from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OUT = sys.argv[1]
RANK = int(os.environ.get("LOCAL_RANK", "0"))  # unset in the process the user started; Lightning sets it for rank 1
logging.basicConfig(
    filename=os.path.join(OUT, f"rank{RANK}.log"), level=logging.INFO, format="%(levelname)s %(name)s %(message)s"
)

# Imported after logging is configured, as an application does.
import lightning.pytorch as pl
from toy import ToyModule, dataloader

import stagesafe

pl.seed_everything(0, verbose=False)
model = ToyModule()
trainer = pl.Trainer(
    strategy=stagesafe.StageSafeDeepSpeedStrategy(stage=3, handoff_uri=os.path.join(OUT, "handoff")),
    accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, default_root_dir=OUT,
)
trainer.validate(model, dataloader(), verbose=False)
trainer.fit(model, train_dataloaders=dataloader())
