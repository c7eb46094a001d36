"""Stage-boundary cost of StageSafeDeepSpeedStrategy against ``safetensors.torch.save_file``, in one run.

Reproduce (CPU, 2 processes, about 100M parameters):
    DS_ACCELERATOR=cpu python benchmarks/bench_boundary.py --layers 6 --width 4096
On GPUs: python benchmarks/bench_boundary.py --accelerator gpu --layers 6 --width 4096

A fit of one step then a test, on one module. For each boundary it reports the time entering the stage
(first handoff) and leaving it (consolidate + publish + destroy + restore), and divides by the time
``safetensors.torch.save_file`` takes to write the same state dict to the same disk, measured right after.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from stagesafe import StageSafeDeepSpeedStrategy  # noqa: E402


class Wide(pl.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch, batch_idx):
        return self.body(batch[0]).float().pow(2).mean()

    def test_step(self, batch, batch_idx):
        self.body(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-bench-boundary"))
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Wide(args.layers, args.width)
    n_params = sum(p.numel() for p in model.parameters())
    data = DataLoader(TensorDataset(torch.randn(4, args.width)), batch_size=2)
    strategy = StageSafeDeepSpeedStrategy(stage=3, handoff_uri=os.path.join(args.root, "handoff"))
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision,
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.root,
    )
    rows = []
    for stage in ("fit", "test"):
        getattr(trainer, stage)(model, data)
        report = strategy.last_boundary
        rows.append((stage, report.enter_seconds, report.seconds, report.wrote, dict(report.phases)))

    if dist.get_rank() != 0:
        return
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    baseline_path = os.path.join(args.root, "baseline.safetensors")
    start = time.perf_counter()
    save_file(state, baseline_path)
    baseline = time.perf_counter() - start
    os.remove(baseline_path)

    print(f"\nmodel: {n_params / 1e6:.1f}M parameters, {nbytes / 1e6:.0f} MB fp32; world size {args.devices}; "
          f"{args.accelerator}, {args.precision}; torch {torch.__version__}")
    print(f"baseline safetensors.torch.save_file of the same state dict: {baseline:.3f} s "
          f"({nbytes / baseline / 1e9:.2f} GB/s)\n")
    print("| stage | enter (s) | enter / save_file | leave (s) | leave / save_file | handoff written | leave phases (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for stage, enter, leave, wrote, phases in rows:
        detail = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
        print(f"| {stage} | {enter:.3f} | {enter / baseline:.2f}x | {leave:.3f} | {leave / baseline:.2f}x | {wrote} | {detail} |")
    print(f"\nreproduce: python benchmarks/bench_boundary.py --layers {args.layers} --width {args.width} "
          f"--accelerator {args.accelerator} --devices {args.devices} --precision {args.precision}")


if __name__ == "__main__":
    main()
