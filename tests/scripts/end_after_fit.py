"""A user's script that ends right after a Trainer call: one rank of a 2-rank job (started by run_ranks).

Usage: python end_after_fit.py SPEC_JSON
SPEC: {"mode": "fit" | "per_rank_folders" | "resume", "root": DIR, "handoff_uri": URL or null,
       "storage_options": {...}, "resume_from": URL, "max_steps": N}
  fit               fit, print the module's digest, end (the handoff write is still running).
  per_rank_folders  each rank its own default_root_dir; fit, then test; print digests.
  resume            a later job: resume_from, test; print the module's digest.
  fit_again         fit, then fit again on the same Trainer (which has reached max_steps): print the warnings.
Rank 0 prints "DIGEST <sha256>" (and "TESTED <sha256>" after a test).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from toy import ToyModule, dataloader, state_digest  # noqa: E402

import stagesafe  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    mode = spec["mode"]
    root = spec["root"] if mode != "per_rank_folders" else os.path.join(spec["root"], f"rank{rank}")
    strategy = stagesafe.StageSafeDeepSpeedStrategy(
        stage=3,
        handoff_uri=spec.get("handoff_uri"),
        storage_options=spec.get("storage_options"),
        resume_from=spec.get("resume_from"),
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=spec.get("max_steps", 3),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root,
    )
    torch.manual_seed(0)
    module = ToyModule()
    if mode == "resume":
        trainer.test(module, dataloaders=dataloader(), verbose=False)
        if rank == 0:
            print("TESTED", state_digest(module), flush=True)
        return
    trainer.fit(module, train_dataloaders=dataloader())
    if rank == 0:
        print("DIGEST", state_digest(module), flush=True)
    if mode == "fit_again":
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, train_dataloaders=dataloader())
        if rank == 0:
            print("AGAIN", state_digest(module), flush=True)
            for warning in caught:
                print("WARNING", str(warning.message).replace("\n", " "), flush=True)
    if mode == "per_rank_folders":
        trainer.test(module, dataloaders=dataloader(), verbose=False)
        if rank == 0:
            print("TESTED", state_digest(module), flush=True)
    # the script ends here: the handoff of the last fit may still be being written


if __name__ == "__main__":
    main()
