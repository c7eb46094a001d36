"""How long leaving ``fit`` blocks, measured from outside the strategy, beside stock DeepSpeedStrategy and the floor.

On two GPUs, the GPT-like model of 1.41B parameters (24 blocks of width 2048, vocabulary 50304):
    python benchmarks/bench_leave_fit.py --accelerator gpu --layers 24 --width 2048 --vocab 50304 --rounds 2
About 7B parameters, stagesafe only:
    python benchmarks/bench_leave_fit.py --accelerator gpu --layers 32 --width 4096 --vocab 50304 --no-stock
On the CPU (2 processes, gloo), a small model:
    DS_ACCELERATOR=cpu python benchmarks/bench_leave_fit.py --layers 2 --width 256 --vocab 1000
With AdamW, the optimizer state kept at the boundary (the default) beside ``keep_optimizer_state=False``:
    python benchmarks/bench_leave_fit.py --accelerator gpu --devices 1 --optimizer adamw --compare-keep --no-stock

bf16-mixed, ZeRO-3, ``fit`` with ``max_steps=1`` (``--steps``); Lightning starts rank 1 by re-running the script. A callback
marks the end of the last optimizer step (``on_train_batch_end``, after synchronizing the device); the time
until ``trainer.fit`` returns is what a user waits for to leave ``fit``. Side by side in one run, rounds
alternating:
- stagesafe: leaving fit; then ``wait_for_handoff()`` (the background write, until committed: its rate against
  the disk's); then ``test`` and ``predict`` on the same module, which is then compared with the handoff bitwise;
  with ``--compare-keep``, also ``keep_optimizer_state=False`` ("no-keep"), and the floor of the kept state's
  bytes (this rank's partition of masters and optimizer state) over the same device-to-host bandwidth;
- stock ``DeepSpeedStrategy`` (Lightning's, CPU refusal lifted on the CPU): leaving fit (its engine stays, and
  no weights come out of it);
- the floor: the fp32 bytes of the model over the device-to-host bandwidth into page-locked memory (on the CPU:
  a memcpy), and the disk: each rank writing half the bytes at once, with write+fsync and early write-back.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stagesafe  # noqa: E402
from bench_boundary import device_to_host_seconds, disk_write_seconds, end_distributed_job  # noqa: E402
from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy  # noqa: E402
from stagesafe.stages import page_lock  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads = max(1, width // 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(pl.LightningModule):
    def __init__(self, layers: int, width: int, vocab: int, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self(tokens[:, :-1]).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def test_step(self, batch, batch_idx):
        self(batch[0])

    def predict_step(self, batch, batch_idx):
        return self(batch[0][:, :8]).argmax(-1)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class EndOfLastStep(Callback):
    """The moment the last optimizer step is done, on the device too."""

    def __init__(self) -> None:
        self.at = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.at = time.perf_counter()


def data(vocab: int, n: int = 4, length: int = 129) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randint(0, vocab, (n, length), generator=g)), batch_size=2)


def leave_fit(args: argparse.Namespace, strategy, root: str) -> tuple[float, pl.Trainer, GPT]:
    torch.manual_seed(0)
    module = GPT(args.layers, args.width, args.vocab, args.optimizer)
    if torch.cuda.is_available():  # none of a fresh module's bytes may be page-locked already (a stale lock)
        stale = [n for n, t in module.state_dict().items() if t.is_pinned() or t.view(-1)[-1:].is_pinned()]
        assert not stale, f"host memory of a new module is page-locked already: {stale[:3]}"
    mark = EndOfLastStep()
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision="bf16-mixed", max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=root, callbacks=[mark],
    )
    trainer.fit(module, train_dataloaders=data(args.vocab))
    return time.perf_counter() - mark.at, trainer, module


def bitwise_equal(module: nn.Module, handoff: dict) -> bool:
    state = module.state_dict()
    return set(state) == set(handoff) and all(
        torch.equal(state[k].view(torch.uint8), handoff[k].view(torch.uint8)) for k in state
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps of each fit")
    parser.add_argument("--no-stock", action="store_true", help="stagesafe only (a model too large for two copies)")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-bench-leave-fit"))
    parser.add_argument("--json", default=None, help="also write rank 0's results here")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--compare-keep", action="store_true", help="also run keep_optimizer_state=False")
    args = parser.parse_args()

    rows: list[dict] = []
    kept_bytes = 0
    variants = [("stagesafe", True), ("no-keep", False)] if args.compare_keep else [("stagesafe", True)]
    for round_, (who, keep) in ((r, v) for r in range(args.rounds) for v in variants):
        strategy = stagesafe.StageSafeDeepSpeedStrategy(
            stage=3, handoff_uri=os.path.join(args.root, "handoff"), keep_optimizer_state=keep
        )
        blocked, trainer, module = leave_fit(args, strategy, args.root)
        if keep:
            kept_bytes = _kept_bytes(module)
        started = time.perf_counter()
        strategy.wait_for_handoff()
        waited = time.perf_counter() - started
        report = strategy.last_boundary
        trainer.test(module, dataloaders=data(args.vocab), verbose=False)
        trainer.predict(module, dataloaders=data(args.vocab))
        rank = trainer.global_rank
        same = None
        if rank == 0:
            same = bitwise_equal(module, stagesafe.load_state_dict(os.path.join(args.root, "handoff")))
        locked = page_lock.locked_ranges()
        rows.append({
            "round": round_, "who": who, "rank": rank, "kept_bytes": _kept_bytes(module), "leave_fit_s": blocked, "wait_for_handoff_s": waited,
            "write_s": report.phases.get("handoff_write"), "private_copy_s": report.phases.get("handoff_write_private_copy"),
            "boundary_s": report.seconds, "consolidate_s": report.phases.get("consolidate"),
            "handoff_bytes": report.handoff_bytes, "module_equals_handoff": same,
            "phases": {k: round(v, 4) for k, v in report.phases.items()},
            "locked_runs_after_round": len(locked),  # the kept state's, while this module lives
            "locked_bytes_after_round": sum(end - start for start, end in locked),
        })
        del trainer, module, strategy
        gc.collect()
        if not args.no_stock and who == "stagesafe":
            stock = (pl.strategies.DeepSpeedStrategy if args.accelerator != "cpu" else CPUCapableDeepSpeedStrategy)(stage=3)
            blocked, trainer, module = leave_fit(args, stock, args.root)
            rows.append({"round": round_, "who": "stock", "rank": trainer.global_rank, "leave_fit_s": blocked})
            trainer.strategy.model.destroy()  # stock keeps its engine: let it go before the next round
            del trainer, module, stock
            gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    nbytes = sum(p.numel() * 4 for p in GPT(args.layers, args.width, args.vocab).parameters())
    floor_s, bandwidth = device_to_host_seconds(nbytes, args.accelerator)
    kept_floor_s = kept_bytes / (bandwidth * 1e9) if bandwidth else 0.0
    if dist.is_initialized():
        dist.barrier()
    probe = os.path.join(args.root, f"probe{dist.get_rank()}")
    os.makedirs(probe, exist_ok=True)
    disk_s = disk_write_seconds(nbytes // dist.get_world_size(), probe, writers=1, early_writeback=True)
    disk = [None] * dist.get_world_size()
    dist.all_gather_object(disk, disk_s)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() != 0:
        return
    disk_rate = nbytes / max(disk) / 1e9
    print(f"\nmodel: {nbytes / 4 / 1e9:.2f}B parameters, {nbytes / 1e9:.2f} GB fp32; {args.devices} x {args.accelerator}")
    print(f"floor: {floor_s:.3f} s ({bandwidth:.1f} GB/s device-to-host, page-locked); disk: {disk_rate:.2f} GB/s "
          f"(each rank writing half at once, write+fsync, early write-back)")
    print(f"kept optimizer state ({args.optimizer}): {kept_bytes / 1e9:.2f} GB on rank 0; its floor {kept_floor_s:.3f} s "
          f"at the same bandwidth; floor of both: {floor_s + kept_floor_s:.3f} s")
    print(f"\n{'round':>5} {'who':>9} {'rank':>4} {'leave fit s':>11} {'x floor':>7} {'write GB/s':>10} {'% disk':>6}  "
          f"bitwise")
    for row in sorted((r for rank_rows in everyone for r in rank_rows), key=lambda r: (r["round"], r["who"], r["rank"])):
        rate = pct = ""
        if row["who"] != "stock" and row["rank"] == 0 and row["write_s"]:
            rate_value = row["handoff_bytes"] / row["write_s"] / 1e9
            rate, pct = f"{rate_value:10.2f}", f"{100 * rate_value / disk_rate:5.0f}%"
        print(f"{row['round']:>5} {row['who']:>9} {row['rank']:>4} {row['leave_fit_s']:11.3f} "
              f"{row['leave_fit_s'] / floor_s:7.1f} {rate:>10} {pct:>6}  {row.get('module_equals_handoff', '') or ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floor_s": floor_s, "kept_floor_s": kept_floor_s, "disk_gbps": disk_rate, "nbytes": nbytes,
                   "rows": everyone}, f, indent=1)


def _kept_bytes(module: nn.Module) -> int:
    """Bytes of this rank's kept DeepSpeed checkpoint files (optimizer partition, masters) after a fit."""
    from stagesafe.stages.history import history_of

    history = history_of(module)
    kept = history.kept if history is not None else None
    total = 0

    def walk(obj) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            total += obj.nbytes
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(kept.checkpoint if kept is not None else None)
    return total


if __name__ == "__main__":
    main()
    end_distributed_job()
