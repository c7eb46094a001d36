"""Peak host memory per rank against model size: between_stages="cpu" against "meta", same handoff, one run.

Reproduce (CPU, 2 processes):  DS_ACCELERATOR=cpu python benchmarks/bench_meta_rss.py --layers 2 6 12
On two GPUs:                   python benchmarks/bench_meta_rss.py --accelerator gpu --width 8192 --layers 4 12 24

For each size a handoff of the model is written once; then, per mode, a new job (2 ranks) starts from it with
``resume_from`` and runs fit -> test -> fit under ZeRO-3. In meta mode the module is built on the meta device,
so no rank ever holds the whole model. Each rank reports its peak RSS (``ru_maxrss``) and its RSS after each
stage. On the CPU the engine's own state (bf16 partitions, fp32 masters, gradients: its share of the model per
rank) lives in host memory too, so it is part of both columns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), ".."))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def job(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from stagesafe import StageSafeDeepSpeedStrategy

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])

        def training_step(self, batch, batch_idx):
            return self.body(batch[0]).float().pow(2).mean()

        def test_step(self, batch, batch_idx):
            self.body(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    with torch.device("meta") if args.mode == "meta" else torch.device("cpu"):
        model = Wide()
    data = DataLoader(TensorDataset(torch.randn(4, args.width)), batch_size=2)
    after = {}
    for stage in ("fit", "test", "fit"):
        strategy = StageSafeDeepSpeedStrategy(
            stage=3, handoff_uri=os.path.join(args.out, "handoff"), resume_from=args.handoff, between_stages=args.mode
        )
        trainer = pl.Trainer(
            accelerator=args.accelerator, devices=2, strategy=strategy, precision="bf16-mixed", max_steps=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=args.out,
        )
        getattr(trainer, stage)(model, data)
        after[f"{len(after)}:{stage}"] = _rss_mb()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(os.path.join(args.out, f"rss.rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"peak_mb": peak, "after_mb": after}, f)
    strategy.wait_for_handoff()
    sys.path.insert(0, os.path.dirname(HERE))
    from bench_boundary import end_distributed_job

    end_distributed_job()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 6, 12])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-bench-meta"))
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--handoff", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        args.layers = args.layers[0]
        job(args)
        return

    import torch

    import stagesafe

    print("| parameters | fp32 size | mode | peak RSS rank 0 / rank 1 (MB) | RSS after fit, test, fit (rank 0, MB) |")
    print("| --- | --- | --- | --- | --- |")
    for layers in args.layers:
        n = layers * (args.width * args.width + args.width)
        handoff = os.path.join(args.root, f"source-{layers}")
        torch.manual_seed(0)
        stagesafe.save_state_dict(
            {f"body.{i}.{k}": v for i in range(layers) for k, v in torch.nn.Linear(args.width, args.width).state_dict().items()},
            handoff,
            overwrite=True,
        )
        for mode in ("cpu", "meta"):
            out = os.path.join(args.root, f"{mode}-{layers}")
            os.makedirs(out, exist_ok=True)
            env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
            if args.accelerator == "cpu":
                env.setdefault("DS_ACCELERATOR", "cpu")
            job_run = subprocess.run(
                [sys.executable, HERE, "--job", "--mode", mode, "--layers", str(layers), "--width", str(args.width),
                 "--handoff", handoff, "--out", out, "--accelerator", args.accelerator],
                env=env, check=False, capture_output=True, text=True,
            )
            if job_run.returncode != 0:  # the job's own last lines say why
                sys.exit(f"the {mode} job with {layers} layers failed (exit {job_run.returncode}):\n"
                         + "\n".join((job_run.stdout + job_run.stderr).splitlines()[-30:]))
            ranks = [json.load(open(os.path.join(out, f"rss.rank{r}.json"))) for r in (0, 1)]
            afters = ", ".join(f"{v:.0f}" for v in ranks[0]["after_mb"].values())
            print(f"| {n / 1e6:.0f}M | {n * 4 / 1e6:.0f} MB | {mode} | {ranks[0]['peak_mb']:.0f} / {ranks[1]['peak_mb']:.0f} | {afters} |",
                  flush=True)
    print(f"\nreproduce: python benchmarks/bench_meta_rss.py --accelerator {args.accelerator} "
          f"--layers {' '.join(map(str, args.layers))} --width {args.width}")


if __name__ == "__main__":
    main()
