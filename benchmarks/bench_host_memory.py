"""Host memory per Trainer call, over one module's sequence of calls, beside stock's single fit of the same model.

One H200, the GPT of bench_leave_fit.py at 4.84B parameters (a run of each, one process each):
    python benchmarks/bench_host_memory.py --accelerator gpu --devices 1 --layers 22 --width 4096 \
        --sequence fit fit test predict
    python benchmarks/bench_host_memory.py --accelerator gpu --devices 1 --layers 22 --width 4096 --stock
``--read-optimizer-state`` reads ``trainer.optimizers[0].state`` after each fit (window ``state``): at one rank it
shows Adam's moments as views into the kept state, so the window's peak stays where it was.
CPU, 2 processes, a 200M-parameter MLP:
    DS_ACCELERATOR=cpu python benchmarks/bench_host_memory.py --model mlp --layers 48 --width 2048 \
        --sequence fit fit fit test
The same with the optimizer state handed off beside the weights at each fit's end (``--handoff-optimizer-state``):
the fit windows' peaks and the seconds of leaving each call, beside a run without it.

bf16-mixed, ZeRO-3, AdamW, a new Trainer per call (``--steps`` optimizer steps per fit). Every rank measures its
own process: RSS when the module is built, then per call the RSS before it, its peak and the RSS after it. The
peak is the kernel's high-water mark (VmHWM), reset before each call through ``/proc/self/clear_refs``: exact, not
sampled. A background write still running when a call returns counts in the next window; the last window,
``wait``, is ``wait_for_handoff()``. On a GPU each call's peak of reserved device memory is reported too.

``--stock``: one fit under Lightning's own DeepSpeedStrategy (the second fit on the same module is the crash this
project exists for), and which host tensors are alive after it: how many bytes, and how many of them are the
optimizer's state (Lightning's ``Strategy.teardown`` moves it to the CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import stagesafe  # noqa: E402
from bench_boundary import Wide, end_distributed_job  # noqa: E402
from bench_leave_fit import GPT, data as gpt_data  # noqa: E402
from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy  # noqa: E402

GIB = 2**30


class MLP(Wide):
    """Square layers: many parameters, little compute (a CPU can train 200M of them in seconds); AdamW."""

    def predict_step(self, batch, batch_idx):
        return self.body(batch[0]).float().sum(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.1)


def status_kib(field: str, path: str = "/proc/self/status") -> int:
    with open(path) as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def reset_peak() -> None:
    """The kernel's high-water mark of this process's RSS starts again from its RSS now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Window:
    """RSS before, peak and after, of what runs inside; GPU peak reserved memory too."""

    def __init__(self, rows: list, name: str) -> None:
        self.rows, self.name = rows, name

    def __enter__(self) -> "Window":
        gc.collect()
        self.before = status_kib("VmRSS") * 1024
        reset_peak()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        seconds = time.perf_counter() - self.start
        row = {"call": self.name, "rss_before": self.before, "rss_peak": status_kib("VmHWM") * 1024,
               "rss_after": status_kib("VmRSS") * 1024, "seconds": seconds,
               # pages the ranks share (their kept optimizer state at several ranks of one host) counted once
               # over the ranks when summed: each mapper's proportional share
               "pss_after": status_kib("Pss", "/proc/self/smaps_rollup") * 1024}
        if torch.cuda.is_available():
            row["gpu_peak_reserved"] = torch.cuda.max_memory_reserved()
        self.rows.append(row)


def build(args: argparse.Namespace) -> pl.LightningModule:
    torch.manual_seed(0)
    if args.model == "gpt":
        module = GPT(args.layers, args.width, args.vocab, "adamw")
    else:
        module = MLP(args.layers, args.width)
    return module


def loader(args: argparse.Namespace) -> DataLoader:
    if args.model == "gpt":
        return gpt_data(args.vocab)
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(4, args.width, generator=g)), batch_size=2)


def trainer_for(args: argparse.Namespace, strategy) -> pl.Trainer:
    return pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision="bf16-mixed",
        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=args.root,
    )


def run_sequence(args: argparse.Namespace, rows: list) -> dict:
    with Window(rows, "build"):
        module = build(args)
    strategy = None
    for call in args.sequence:
        strategy = stagesafe.StageSafeDeepSpeedStrategy(
            stage=3, handoff_uri=os.path.join(args.root, "handoff"), keep_optimizer_state=not args.no_keep,
            between_stages=args.between_stages, handoff_optimizer_state=args.handoff_optimizer_state,
        )
        trainer = trainer_for(args, strategy)
        with Window(rows, call):
            if call == "fit":
                trainer.fit(module, train_dataloaders=loader(args))
            elif call == "test":
                trainer.test(module, dataloaders=loader(args), verbose=False)
            else:
                trainer.predict(module, dataloaders=loader(args))
        rows[-1]["kept_bytes"] = kept_bytes(module)
        report = strategy.last_boundary
        if report is not None:  # leaving the call: the boundary, and of it the optimizer state's hand-off
            rows[-1]["boundary_s"] = report.seconds
            rows[-1]["optimizer_state_s"] = report.phases.get("optimizer_state")
        if call == "fit" and args.read_optimizer_state:
            with Window(rows, "state"):  # each parameter's state read once: on a GPU, waits for its copy off it
                exposed = optimizer_state_bytes(trainer.optimizers[0], module) if trainer.optimizers else (0, 0)
            rows[-1]["state_bytes"], rows[-1]["state_new_bytes"] = exposed
        del trainer
    with Window(rows, "wait"):
        strategy.wait_for_handoff()
    return {"parameters": sum(p.numel() for p in module.parameters())}


def run_stock(args: argparse.Namespace, rows: list) -> dict:
    with Window(rows, "build"):
        module = build(args)
    parameters = sum(p.numel() for p in module.parameters())  # stock's fit leaves them hollow
    stock = (pl.strategies.DeepSpeedStrategy if args.accelerator != "cpu" else CPUCapableDeepSpeedStrategy)(stage=3)
    trainer = trainer_for(args, stock)
    with Window(rows, "fit"):
        trainer.fit(module, train_dataloaders=loader(args))
    gc.collect()
    live = [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() >= 2**20]
    state = {id(t) for opt in trainer.strategy.optimizers for s in opt.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live}
    in_state = {t.untyped_storage().data_ptr() for t in live if id(t) in state}
    return {
        "parameters": parameters,
        "live_host_tensors": len(live),
        "live_host_bytes": sum(storages.values()),
        "live_host_bytes_optimizer_state": sum(storages[p] for p in in_state),
        "live_host_tensors_optimizer_state": [[list(t.shape), str(t.dtype)] for t in live if id(t) in state],
    }


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, module: nn.Module) -> tuple[int, int]:
    """Bytes of the tensors the given-back optimizer's state shows for the module's parameters, and of those
    bytes the ones outside what stagesafe keeps of the fit (a copy would be; views into the kept state are not)."""
    kept = kept_storages(module)
    shown = [t for p in module.parameters() for t in optimizer.state[p].values() if isinstance(t, torch.Tensor)]
    return (sum(t.nbytes for t in shown), sum(t.nbytes for t in shown if t.untyped_storage().data_ptr() not in kept))


def kept_bytes(module: nn.Module) -> int:
    """Bytes of what this rank keeps of the last fit's engine (optimizer state, fp32 masters of 16-bit ones)."""
    return sum(kept_storages(module).values())


def kept_storages(module: nn.Module) -> dict[int, int]:
    """Address -> bytes of each storage this rank keeps of the last fit's engine; of the state the ranks of one
    host share, this rank's share, once every rank has written its part."""
    from stagesafe.stages.history import history_of
    from stagesafe.zero.engine import tensors_in

    history = history_of(module)
    kept = history.kept if history is not None else None
    if kept is None:
        return {}
    if kept.shared is not None and kept.copied is not None:  # several ranks of one host: once each has written
        kept.copied.wait()  # its part (after the call's window), and let go of its partitions
        kept.shared.ready(600.0)
    tensors = [*tensors_in(kept.checkpoint), *kept.masters.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    if kept.shared is not None:  # the host's ranks hold it once: this rank's share of it
        region = kept.shared.region
        storages[region.private().data_ptr()] = region.nbytes // region.ranks
    return storages


def show(everyone: list, info: dict, args: argparse.Namespace) -> None:
    params = info["parameters"]
    print(f"\nmodel: {args.model}, {params / 1e9:.3f}B parameters ({params * 4 / GIB:.1f} GiB fp32); "
          f"{args.devices} x {args.accelerator}; {'stock DeepSpeedStrategy' if args.stock else 'stagesafe'}"
          + ("" if args.stock else f", keep_optimizer_state={not args.no_keep}, between_stages={args.between_stages!r}, "
             f"handoff_optimizer_state={args.handoff_optimizer_state}"))
    print(f"{'rank':>4} {'call':>8} {'RSS before':>11} {'peak':>9} {'after':>9} {'peak-before':>12} "
          f"{'B/param':>8} {'kept':>9} {'GPU peak':>9} {'s':>7}  (GiB)")
    for rank, rows in enumerate(everyone):
        for row in rows:
            gpu = f"{row['gpu_peak_reserved'] / GIB:9.1f}" if "gpu_peak_reserved" in row else f"{'':>9}"
            kept = f"{row['kept_bytes'] / GIB:9.2f}" if "kept_bytes" in row else f"{'':>9}"
            print(f"{rank:>4} {row['call']:>8} {row['rss_before'] / GIB:11.1f} {row['rss_peak'] / GIB:9.1f} "
                  f"{row['rss_after'] / GIB:9.1f} {(row['rss_peak'] - row['rss_before']) / GIB:12.1f} "
                  f"{row['rss_peak'] / params:8.1f} {kept} {gpu} {row['seconds']:7.1f}")
    for rank, rows in enumerate(everyone):
        for row in rows:
            if "state_bytes" in row:
                print(f"rank {rank} state: trainer.optimizers[0].state shows {row['state_bytes'] / 2**20:.1f} MiB of "
                      f"tensors, {row['state_new_bytes'] / 2**20:.1f} MiB of them outside the kept state")
            if row.get("boundary_s") is not None:
                state = row.get("optimizer_state_s")
                print(f"rank {rank} {row['call']}: leaving it took {row['boundary_s']:.3f} s"
                      + (f", of which handing off the optimizer state {state:.3f} s" if state is not None else ""))
    if len(everyone) > 1:
        for index, row in enumerate(everyone[0]):
            pss = [rows[index].get("pss_after", 0) for rows in everyone if index < len(rows)]
            print(f"after {row['call']}: the ranks together hold {sum(pss) / GIB:.2f} GiB (PSS summed, "
                  f"{sum(pss) / params:.1f} B/param)")
    for key in ("live_host_tensors", "live_host_bytes", "live_host_bytes_optimizer_state",
                "live_host_tensors_optimizer_state"):
        if key in info:
            print(f"{key}: {info[key]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps of each fit")
    parser.add_argument("--sequence", nargs="+", default=["fit", "fit", "test", "predict"],
                        choices=("fit", "test", "predict"))
    parser.add_argument("--stock", action="store_true", help="one fit under stock DeepSpeedStrategy instead")
    parser.add_argument("--no-keep", action="store_true", help="keep_optimizer_state=False")
    parser.add_argument("--handoff-optimizer-state", action="store_true", help="handoff_optimizer_state=True")
    parser.add_argument("--between-stages", default="cpu", choices=("cpu", "meta"))
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-bench-host-memory"))
    parser.add_argument("--read-optimizer-state", action="store_true",
                        help="after each fit, read trainer.optimizers[0].state for every parameter (window 'state')")
    parser.add_argument("--json", default=None, help="also write every rank's rows here (rank 0)")
    args = parser.parse_args()

    rows: list[dict] = []
    info = run_stock(args, rows) if args.stock else run_sequence(args, rows)
    everyone: list = [rows]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        if dist.get_rank() != 0:
            return
    show(everyone, info, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **info, "ranks": everyone}, f, indent=1)


if __name__ == "__main__":
    main()
    end_distributed_job()
