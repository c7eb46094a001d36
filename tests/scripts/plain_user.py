"""A user's own script, as a new user writes it: no warning filters, no logging setup, Lightning's own launcher
(``devices=2`` re-launches this script for rank 1). fit for 16 steps, then test; run by tests/test_warnings.py,
which counts the lines it prints on stderr.

Usage: python plain_user.py ROOT
"""

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stagesafe


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


if __name__ == "__main__":
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=stagesafe.StageSafeDeepSpeedStrategy(stage=3), max_steps=16,
        default_root_dir=sys.argv[1], logger=False, enable_progress_bar=False,
    )
    model = Regressor()
    trainer.fit(model, data())
    trainer.test(model, data())
