"""What a user reads of the Trainer after each kind of call: ``trainer.optimizers`` and
``trainer.lr_scheduler_configs``, under stagesafe or under stock DDP (the same script), 2 CPU ranks.

Usage: python trainer_attributes.py {stagesafe|ddp} ROOT
Lightning starts rank 1 by re-running this command line. AdamW in two param groups (lrs 1e-2 and 1e-3, betas
(0.8, 0.95), weight decay 0.1) and a StepLR stepped every step; fit for 6 steps, then test, then predict. After
each call rank 0 prints "ATTRS <call> <json>" (see ``_attributes``), and every rank "STATE <rank> <call> <json>":
the optimizer's state per parameter name (each key's shape and values).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from plain_user import Regressor as PlainRegressor  # noqa: E402
from plain_user import data  # noqa: E402

import stagesafe  # noqa: E402


class Regressor(PlainRegressor):
    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        groups = [{"params": self.net[0].parameters(), "lr": 1e-2}, {"params": self.net[2].parameters(), "lr": 1e-3}]
        optimizer = torch.optim.AdamW(groups, betas=(0.8, 0.95), weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _attributes(trainer: pl.Trainer, model: pl.LightningModule) -> dict:
    """The optimizers (class, each group's hyperparameters and the module's names of its parameters, whether
    they are the module's own objects, how many parameters have state) and the lr schedulers (class, interval,
    last_epoch, last lrs, whether they step the optimizer listed)."""
    names = {id(p): n for n, p in model.named_parameters()}
    optimizers = []
    for optimizer in trainer.optimizers:
        groups = [{"lr": g["lr"], "betas": list(g["betas"]), "weight_decay": g["weight_decay"],
                   "params": [names.get(id(p), "?") for p in g["params"]]} for g in optimizer.param_groups]
        optimizers.append({"class": type(optimizer).__name__, "groups": groups,
                           "with_state": sum(1 for state in optimizer.state.values() if state)})
    schedulers = [{"class": type(c.scheduler).__name__, "interval": c.interval, "last_epoch": c.scheduler.last_epoch,
                   "last_lr": c.scheduler.get_last_lr(), "steps_listed": c.scheduler.optimizer in trainer.optimizers}
                  for c in trainer.lr_scheduler_configs]
    return {"optimizers": optimizers, "schedulers": schedulers}


def _state(trainer: pl.Trainer, model: pl.LightningModule) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names.get(id(p), "?"): {key: [list(value.shape), value.flatten().tolist()] if torch.is_tensor(value)
                                      else [None, value] for key, value in held.items()}
            for optimizer in trainer.optimizers for p, held in optimizer.state.items() if held}


if __name__ == "__main__":
    kind, root = sys.argv[1], sys.argv[2]
    strategy = stagesafe.StageSafeDeepSpeedStrategy(stage=3) if kind == "stagesafe" else "ddp"
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=6, default_root_dir=root, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )
    torch.manual_seed(0)
    model = Regressor()
    for call in ("fit", "test", "predict"):
        getattr(trainer, call)(model, data(), **({"verbose": False} if call == "test" else {}))
        if trainer.global_rank == 0:
            print("ATTRS", call, json.dumps(_attributes(trainer, model)), flush=True)
        print("STATE", trainer.global_rank, call, json.dumps(_state(trainer, model)), flush=True)
