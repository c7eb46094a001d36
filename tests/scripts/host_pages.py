"""Two fits of one module on one device, in a process of its own: where the module's trainable fp32 weights live
in host memory before and after each fit (stagesafe's own pages, page-locked or not, at which addresses), and
whether they equal the handoff bitwise. Prints one JSON line.

Usage: python host_pages.py ACCELERATOR ROOT      (ACCELERATOR: gpu or cpu)
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
import stagesafe  # noqa: E402
from stagesafe.stages import page_lock  # noqa: E402
from toy import ToyModule, dataloader, quiet_trainer, state_digest, state_digest_of  # noqa: E402


def fit(module: pl.LightningModule, accelerator: str, root: str) -> None:
    trainer = quiet_trainer(root, "fits", devices=1, max_steps=2, accelerator=accelerator)
    trainer.fit(module, dataloader())
    trainer.strategy.wait_for_handoff()


def where(module: pl.LightningModule, root: str | None) -> dict:
    params = {n: p for n, p in module.named_parameters() if p.requires_grad and p.dtype == torch.float32}
    seen = {
        "own_pages": sorted(n for n, p in params.items() if page_lock.lockable(p)),
        "pinned": sorted(n for n, p in params.items() if p.is_pinned()),
        "addresses": {n: p.data_ptr() for n, p in params.items()},
        "names": sorted(params),
    }
    if root is not None:
        handoff = stagesafe.load_state_dict(os.path.join(root, "fits", "handoff"))
        seen["equals_handoff"] = state_digest(module) == state_digest_of(handoff)
    return seen


def main() -> None:
    accelerator, root = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    module = ToyModule()
    before = where(module, None)
    fit(module, accelerator, root)
    first = where(module, root)
    fit(module, accelerator, root)
    second = where(module, root)
    print(json.dumps({"before": before, "first": first, "second": second}), flush=True)


if __name__ == "__main__":
    main()
