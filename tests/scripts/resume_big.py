"""A big model's checkpoint of 2 CPU ranks resumed on one process with ``fit(ckpt_path=)``; the load timed, and its
host memory sampled (benchmarks/bench_resume.py ``--one-gpu``).

Usage: python resume_big.py PHASE OUT --stage S --hidden H --layers L [--accelerator gpu|cpu] [--devices M]
PHASE ``save``: stock Lightning's DeepSpeed strategy (stagesafe's CPU-enabled base class) on 2 CPU ranks (gloo),
  bf16-mixed, AdamW with weight decay, 2 steps, then ``trainer.save_checkpoint(OUT/ckpt)`` while the engine lives.
PHASE ``resume``: a new module on one process (the GPU, or the CPU; ``--devices M``: M ranks),
  ``StageSafeDeepSpeedStrategy``, ``fit(ckpt_path=OUT/ckpt, max_steps=3)``: one step after the resume. The strategy's ``load_checkpoint`` (every
  rank file read by stagesafe's reader, re-partitioned for one rank, put into the engine) is timed, and this
  process's peak resident memory during it read from the kernel (VmHWM, reset when the load starts).
Rank 0 prints ``DONE <json>``. DeepSpeed's CPU comm op is not built (``--build-comm-op`` builds it): gloo carries
the collectives, as it does where the op cannot be built, and a first build takes minutes.
Lightning starts the other rank by running this command line again.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_peak import RssPeak, host_breakdown  # noqa: E402
from make_zero_checkpoint import BigNet  # noqa: E402


class BigModule(pl.LightningModule):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.net = BigNet(hidden, layers)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x.to(next(self.net.parameters()).dtype)).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)

    def train_dataloader(self):
        torch.manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, self.hidden)), batch_size=2)


def save(args: argparse.Namespace) -> dict:
    from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy

    pl.seed_everything(1, verbose=False)
    module = BigModule(args.hidden, args.layers)
    trainer = pl.Trainer(
        strategy=CPUCapableDeepSpeedStrategy(stage=args.stage), accelerator="cpu", devices=2, precision="bf16-mixed",
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(module)
    fitted = time.perf_counter()
    trainer.save_checkpoint(f"{args.out}/ckpt")
    return {"fit_seconds": fitted - start, "save_seconds": time.perf_counter() - fitted,
            "global_step": trainer.global_step}


def resume(args: argparse.Namespace) -> dict:
    from stagesafe import StageSafeDeepSpeedStrategy

    peak = RssPeak()
    timing: dict = {}

    class Timed(StageSafeDeepSpeedStrategy):
        def load_checkpoint(self, checkpoint_path, weights_only=None):
            timing["host_before_load"] = host_breakdown()
            peak.start()
            start = time.perf_counter()
            try:
                return super().load_checkpoint(checkpoint_path, weights_only)
            finally:
                timing["load_seconds"] = time.perf_counter() - start
                peak.stop()
                timing["host_after_load"] = host_breakdown()

    pl.seed_everything(2, verbose=False)
    module = BigModule(args.hidden, args.layers)
    strategy = Timed(stage=args.stage, handoff_uri=f"{args.out}/handoff", overwrite_handoff=True,
                     keep_optimizer_state=False, wait_for_write=True)
    trainer = pl.Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=args.devices, precision="bf16-mixed", max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(module, ckpt_path=f"{args.out}/ckpt")
    out = {
        **timing,
        "fit_seconds": time.perf_counter() - start,
        "rss_before_load_mib": peak.before / 2**20,
        "rss_peak_during_load_mib": peak.peak / 2**20,
        "rss_after_load_mib": peak.after / 2**20,
        "rss_peak_exact": peak.exact,
        "devices": args.devices,
        "process_peak_rss_mib": max(peak.earlier, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20,
        "global_step": trainer.global_step,
        "host_after_fit": host_breakdown(),
        "parameters": sum(p.numel() for p in module.parameters()),
    }
    if torch.cuda.is_available() and args.accelerator == "gpu":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=("save", "resume"))
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--devices", type=int, default=1, help="resume: how many ranks resume")
    parser.add_argument("--build-comm-op", action="store_true")
    args = parser.parse_args()
    if not args.build_comm_op:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__ = {}  # DeepSpeed's comm backend then builds no CPU comm op: gloo's own
    facts = (save if args.phase == "save" else resume)(args)
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        print("DONE " + json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
