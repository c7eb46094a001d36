"""validate -> fit -> test -> predict on one LightningModule under DeepSpeed ZeRO-3, CPU, 2 processes.

    DS_ACCELERATOR=cpu python examples/stage_sequence.py [--handoff-uri URL] [--precision bf16-mixed]

The handoff goes to a folder of this checkout's own under the temporary directory (``stagesafe-demo-<hash of the
checkout's path>``) unless ``--handoff-uri`` names one; a new run of the demo replaces the last one's there.

After every Trainer call StageSafeDeepSpeedStrategy writes the weights as safetensors (the handoff),
destroys the engine and gives the module back plain tensors. This prints, per stage, the time spent at the
boundary, the handoff's size and the clean check, then proves the module and the handoff hold the same bits.
Lightning starts rank 1 by re-running this script; only rank 0 prints.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stagesafe


class TinyLM(pl.LightningModule):
    """An embedding, two layers and a head: enough for ZeRO-3 to partition and hook every layer."""

    def __init__(self, vocab: int = 101, dim: int = 64) -> None:
        super().__init__()
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

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(n: int = 256) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 101, (n,), generator=g)
    return DataLoader(TensorDataset(tokens, (tokens * 7 + 3) % 101), batch_size=16)


def _demo_folder() -> str:
    """This checkout's own folder for the demo's handoff: two checkouts on one machine never share one."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tag = hashlib.sha256(checkout.encode()).hexdigest()[:8]
    return os.path.join(tempfile.gettempdir(), f"stagesafe-demo-{tag}", "handoff")


def main() -> None:
    # This demo's own output only: Lightning's notices about its own internals (once per rank) say nothing about
    # this script. (torch's per-step deprecation notices about DeepSpeed's collectives the strategy filters itself,
    # for every script: docs/troubleshooting.md#per-step-warnings.)
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    warnings.filterwarnings("ignore", message=".*DistributedSampler.*")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--handoff-uri", default=_demo_folder())
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    model = TinyLM()
    # overwrite_handoff: the demo's folder holds the last run's handoff, which this run replaces
    strategy = stagesafe.StageSafeDeepSpeedStrategy(stage=3, handoff_uri=args.handoff_uri, overwrite_handoff=True)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision,
        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=os.path.dirname(args.handoff_uri),
    )
    rows = []
    for stage in ("validate", "fit", "test", "predict"):
        if stage == "fit":
            trainer.fit(model, train_dataloaders=data(), val_dataloaders=data(64))
        elif stage == "predict":
            trainer.predict(model, data())
        else:
            getattr(trainer, stage)(model, data(), verbose=False)
        report = strategy.last_boundary
        weight = model.net[1].weight
        rows.append((stage, report, weight.numel(), str(weight.dtype)))

    strategy.wait_for_handoff()  # every rank: the last handoff is committed before anyone reads it
    if trainer.global_rank != 0:
        return
    print(f"\nstagesafe demo: ZeRO-3, {args.devices} x {args.accelerator}, {args.precision}; handoff at {args.handoff_uri}\n")
    print(f"{'stage':<9} {'enter s':>8} {'leave s':>8} {'handoff':>10} {'written':>8}  clean  weight after")
    for stage, report, numel, dtype in rows:
        clean = "yes" if report.clean else "NO: " + "; ".join(report.stale_problems)
        n = report.handoff_bytes  # the tensors' bytes, shown as the commit line shows them
        size = f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"
        print(f"{stage:<9} {report.enter_seconds:8.3f} {report.seconds:8.3f} {size if report.wrote else '-':>10} "
              f"{'yes' if report.wrote else 'no':>8}  {clean:<5}  {numel} x {dtype}")
    handoff = stagesafe.load_state_dict(args.handoff_uri)
    same = all(torch.equal(handoff[k], v) for k, v in model.state_dict().items())
    manifest = stagesafe.verify(args.handoff_uri)
    print(f"\nmodule.state_dict() == handoff, bitwise: {same}; shards verified: {len(manifest['shards'])}; "
          f"last written by '{manifest['metadata']['stage']}' at step {manifest['metadata']['global_step']}")


if __name__ == "__main__":
    main()
