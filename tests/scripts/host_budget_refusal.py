"""A fit on 2 CPU ranks under a cgroup memory limit that leaves too little for the end of the stage: every rank
should raise HostMemoryError before any step. Prints one JSON line per rank: the error's type and message, the
trainer's global step, and whether the module still holds the weights it was built with.

The process moves itself into the cgroup before anything is imported (Lightning's rank 1, its child, follows).
Once the module is built, as each rank's optimizer is made (just before DeepSpeed builds the engine), the limit is
set to the cgroup's usage plus ``ROOM`` bytes: enough for the engine to be built, far less than the stage's end
asks for with the check's margin.

Usage: python host_budget_refusal.py CGROUP_FOLDER VERSION ROOT ROOM_BYTES
"""

from __future__ import annotations

import json
import os
import sys

FOLDER, VERSION, ROOT, ROOM = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
if "LOCAL_RANK" not in os.environ:  # the launching process; its children inherit the cgroup
    with open(os.path.join(FOLDER, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from stagesafe import StageSafeDeepSpeedStrategy  # noqa: E402


def limit_to_usage_plus(room: int) -> None:
    usage_file, limit_file = (("memory.current", "memory.max") if VERSION == 2 else
                              ("memory.usage_in_bytes", "memory.limit_in_bytes"))
    with open(os.path.join(FOLDER, usage_file)) as f:
        usage = int(f.read())
    with open(os.path.join(FOLDER, limit_file), "w") as f:
        f.write(str(usage + room))


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(48)])  # 50M parameters

    def training_step(self, batch, batch_idx):
        return self.body(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        self.trainer.strategy.barrier()  # both ranks have built their module
        if self.global_rank == 0:
            limit_to_usage_plus(ROOM)
        self.trainer.strategy.barrier()
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    torch.manual_seed(0)
    module = Wide()
    before = {n: t.clone() for n, t in module.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=StageSafeDeepSpeedStrategy(stage=3, handoff_uri=f"{ROOT}/handoff"),
        precision="bf16-mixed", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=ROOT,
    )
    data = DataLoader(TensorDataset(torch.randn(8, 1024)), batch_size=2)
    seen = {"rank": int(os.environ.get("LOCAL_RANK", 0)), "error": None, "message": ""}
    try:
        trainer.fit(module, data)
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        seen["error"], seen["message"] = type(exc).__name__, str(exc)
    state = module.state_dict()
    seen["global_step"] = trainer.global_step
    seen["unchanged"] = set(state) == set(before) and all(torch.equal(state[n], before[n]) for n in before)
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
