"""LightningCLI with stagesafe: pick the strategy by name or by class path, from YAML or the command line.

    DS_ACCELERATOR=cpu python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    DS_ACCELERATOR=cpu python examples/lightning_cli.py fit --config examples/lightning_cli_class_path.yaml
    DS_ACCELERATOR=cpu python examples/lightning_cli.py fit --trainer.strategy=stagesafe_deepspeed_stage_3 \\
        --trainer.accelerator=cpu --trainer.devices=2

``import stagesafe`` registers the names ``stagesafe_deepspeed_stage_{1,2,3}``, ``..._stage_2_offload`` and
``..._stage_3_offload``, before or after Lightning's imports.
The class path form (``class_path: stagesafe.StageSafeDeepSpeedStrategy`` with ``init_args``) reaches every
argument, ``handoff_uri`` and ``storage_options`` included.

After ``fit`` this CLI runs ``test`` on the same module, in the same process: the step that fails under stock
ZeRO-3. Each stage boundary logs one line on rank 0 (logger ``stagesafe``).
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stagesafe  # registers the stagesafe_deepspeed_* names, whatever was imported first


class TinyLM(pl.LightningModule):
    """An embedding, two layers and a head: enough for ZeRO-3 to partition and hook every layer."""

    def __init__(self, vocab: int = 101, dim: int = 64, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, vocab))

    def _loss(self, batch) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self.net(tokens).float(), targets)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TokenData(pl.LightningDataModule):
    """Token -> (7 * token + 3) mod vocab: learnable in a few steps."""

    def __init__(self, vocab: int = 101, size: int = 256, batch_size: int = 16) -> None:
        super().__init__()
        self.vocab, self.size, self.batch_size = vocab, size, batch_size

    def _loader(self, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (self.size,), generator=g)
        return DataLoader(TensorDataset(tokens, (tokens * 7 + 3) % self.vocab), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(1)

    def test_dataloader(self) -> DataLoader:
        return self._loader(2)


class StageSafeCLI(LightningCLI):
    """After ``fit``, ``test`` the same module with the same Trainer, then say where the handoff is."""

    def after_fit(self) -> None:
        self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        strategy = self.trainer.strategy
        if not isinstance(strategy, stagesafe.StageSafeDeepSpeedStrategy) or not self.trainer.is_global_zero:
            return
        report = strategy.last_boundary
        manifest = stagesafe.verify(report.uri, storage_options=strategy.storage_options)
        meta = manifest["metadata"]
        print(
            f"strategy: {type(strategy).__name__} (ZeRO stage {meta['zero_stage']}, {meta['world_size']} ranks)\n"
            f"handoff: {report.uri} ({len(manifest['shards'])} shard(s), written by '{meta['stage']}' at step "
            f"{meta['global_step']})\n"
            f"test_loss: {float(self.trainer.callback_metrics['test_loss']):.4f}"
        )


def main() -> None:
    # One INFO line per stage boundary from stagesafe, as Lightning logs its own messages.
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("stagesafe").setLevel(logging.INFO)
    StageSafeCLI(TinyLM, TokenData, seed_everything_default=0, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
