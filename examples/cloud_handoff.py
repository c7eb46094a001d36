"""Two jobs, one handoff in an object store: job A trains on 2 ranks, job B (a new process, 1 rank) tests.

    # job A: fit under ZeRO-3; the strategy writes the handoff to S3 at the end of fit
    DS_ACCELERATOR=cpu python examples/cloud_handoff.py train --handoff-uri s3://bucket/run1/handoff
    # job B, later, elsewhere: a fresh module takes the weights from S3 before its first stage
    DS_ACCELERATOR=cpu python examples/cloud_handoff.py test --resume-from s3://bucket/run1/handoff \\
        --handoff-uri s3://bucket/run1/tested

Any fsspec URL works (``gs://``, ``az://``, ``memory://``, a shared file system path); the matching package
(``stagesafe[s3]``, ``[gcs]``, ``[azure]``) must be installed. Credentials come from the usual places
(environment variables, profiles, instance roles); ``--endpoint-url`` points s3fs at an S3-compatible server
(MinIO, Ceph, moto, a local gateway), and each ``--storage-option KEY=VALUE`` goes to fsspec as it is (VALUE
read as JSON when it parses). The test suite runs both jobs against a local S3-protocol server.

A handoff carries no world size: job A's 2-rank handoff is read by job B's single rank as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

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

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(seed: int, n: int = 256) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 101, (n,), generator=g)
    return DataLoader(TensorDataset(tokens, (tokens * 7 + 3) % 101), batch_size=16)


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.endpoint_url:
        options["endpoint_url"] = args.endpoint_url  # s3fs: an S3-compatible server instead of AWS
    for item in args.storage_option:
        key, _, raw = item.partition("=")
        try:
            options[key] = json.loads(raw)
        except ValueError:
            options[key] = raw
    return options


def trainer(args: argparse.Namespace, strategy: stagesafe.StageSafeDeepSpeedStrategy, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=args.devices, precision="bf16-mixed",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=args.root, **kwargs,
    )


def train(args: argparse.Namespace) -> None:
    """Job A: fit; the strategy publishes the weights to ``--handoff-uri`` when fit ends."""
    pl.seed_everything(0, verbose=False)
    options = storage_options(args)
    strategy = stagesafe.StageSafeDeepSpeedStrategy(stage=3, handoff_uri=args.handoff_uri, storage_options=options)
    t = trainer(args, strategy, max_epochs=2)
    t.fit(TinyLM(), train_dataloaders=data(seed=0))
    # fit returned once the module held its weights; the handoff is still being written. Join the write (every
    # rank) before reading it; a script that just ends here would also wait for it, and fail if it fails.
    strategy.wait_for_handoff()
    if t.global_rank == 0:
        manifest = stagesafe.verify(args.handoff_uri, storage_options=options)  # re-hash what is in the store
        meta = manifest["metadata"]
        print(f"job A: fit on {meta['world_size']} ranks wrote {args.handoff_uri} at step {meta['global_step']}: "
              f"{len(manifest['shards'])} shard(s), {manifest['total_size']} bytes, "
              f"{manifest.get('digest', 'sha256')} verified")


def test(args: argparse.Namespace) -> None:
    """Job B: a fresh module resumes from job A's handoff, then runs ``test`` under ZeRO-3."""
    pl.seed_everything(1, verbose=False)  # a different init: whatever the test measures came from the store
    options = storage_options(args)
    strategy = stagesafe.StageSafeDeepSpeedStrategy(
        stage=3, resume_from=args.resume_from, handoff_uri=args.handoff_uri, storage_options=options
    )
    model = TinyLM()
    t = trainer(args, strategy)
    (metrics,) = t.test(model, data(seed=2), verbose=False)
    strategy.wait_for_handoff()  # every rank: test's handoff is committed before the job ends
    if t.global_rank != 0:
        return
    # Without Lightning: stagesafe.restore loads the same handoff into any module of the same class.
    reference = stagesafe.restore(TinyLM(), args.resume_from, storage_options=options)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    print(f"job B: resumed from {args.resume_from} on {t.world_size} rank(s); test_loss {metrics['test_loss']:.4f}; "
          f"module == restore(TinyLM(), handoff), bitwise: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", choices=("train", "test"))
    parser.add_argument("--handoff-uri", required=True, help="where this job's strategy writes its handoff")
    parser.add_argument("--resume-from", help="test: the handoff job A wrote")
    parser.add_argument("--endpoint-url", help="an S3-compatible server, e.g. http://127.0.0.1:9000")
    parser.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, help="default: 2 for train, 1 for test")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-cloud"))
    args = parser.parse_args()
    if args.job == "test" and not args.resume_from:
        parser.error("test needs --resume-from, the handoff URI job A wrote")
    args.devices = args.devices or (2 if args.job == "train" else 1)
    (train if args.job == "train" else test)(args)


if __name__ == "__main__":
    main()
