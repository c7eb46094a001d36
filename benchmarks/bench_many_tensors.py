"""Many small tensors: stagesafe's share of a stage beside stock Lightning's, and DeepSpeed's own share apart.

Reproduce (CPU, 2 processes; one job per row, each a fresh process):
    DS_ACCELERATOR=cpu python benchmarks/bench_many_tensors.py --counts 20000 70000
One job alone (what the table's rows run):
    DS_ACCELERATOR=cpu python benchmarks/bench_many_tensors.py --job stagesafe --tensors 20000

A module of N parameters of ``--floats`` floats each (the same bytes in ``--few`` tensors as the baseline), AdamW,
bf16-mixed, ZeRO-3, a new Trainer per call: validate -> fit (one step) -> test. Measured per call: its wall time,
stagesafe's boundary (entering: the clean check, the plan and, for a fit, the exact fp32 values loaded into
the new engine's masters; leaving: consolidate, destroy, restore, publish)
and each rank's peak RSS (the kernel's high-water mark, reset before each call). ``stock`` runs the same calls
under Lightning's own DeepSpeedStrategy (its later calls on the same module are what this project fixes: a
failure is recorded, not raised).

``--save-state-dict`` times what the handoff write costs per tensor on its own, without a job:
``stagesafe.save_state_dict`` of N tensors of ``--floats`` floats and of the same bytes in ``--few`` tensors, in a
fresh process per row, ``--repeat`` saves each (the first into an empty folder, the others replacing it, as a
stage's handoff replaces the last); ``--trees`` times the stagesafe of other source trees in the same run (a
``git archive`` of an older commit: before and after side by side, interleaved). ``--arms`` with no value skips
the Trainer rows. ``--floor`` times, the same way, what any boundary that handles each tensor pays however it is
written: one ``.data`` assignment a parameter, ``module.state_dict()``, safetensors' own ``save_file`` and
``load_file``:
    python benchmarks/bench_many_tensors.py --arms --save-state-dict --counts 5000 20000 70000 --trees /tmp/old .

DeepSpeed's engine checks the optimizer's groups for duplicates with a loop over the parameters that lists every
group's ids again for each one (``DeepSpeedEngine._check_for_duplicates``): quadratic, about 200 s at 20,000
parameters, paid by stock and stagesafe alike at every fit. ``--duplicate-check`` times it alone, without a job;
``--linear-duplicate-check`` gives both arms the same linear check (same assertion) so that 70,000 tensors fit
in a run: the rows then show everything else.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import stagesafe  # noqa: E402
from bench_boundary import end_distributed_job  # noqa: E402
from bench_host_memory import Window  # noqa: E402
from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy  # noqa: E402

SEQUENCE = ("validate", "fit", "test")


class ManyTensors(pl.LightningModule):
    """``count`` parameters of ``size`` floats each, registered on one module; the forward uses every one."""

    def __init__(self, count: int, size: int) -> None:
        super().__init__()
        self.count, self.size = count, size
        g = torch.Generator().manual_seed(0)
        for i in range(count):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(size, generator=g) * 0.01))

    def forward(self, x):
        return x @ torch.cat([getattr(self, f"p{i}") for i in range(self.count)]).view(-1, 16).T

    def training_step(self, batch, batch_idx):
        return self(batch[0]).float().pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self(batch[0])

    def test_step(self, batch, batch_idx):
        self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


def linear_duplicate_check(engine, optimizer) -> None:
    """DeepSpeed's check, the same assertion, in one pass over the groups."""
    counts: dict[int, int] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            counts[id(param)] = counts.get(id(param), 0) + 1
    for name, param in engine.module.named_parameters():
        assert counts.get(id(param), 0) <= 1, f"Parameter with name: {name} occurs multiple times in param_groups"


def time_duplicate_check(count: int) -> float:
    """Seconds of DeepSpeed's own check on a module of ``count`` parameters (no engine needed)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    module = nn.Module()
    for i in range(count):
        module.register_parameter(f"p{i}", nn.Parameter(torch.zeros(16)))
    optimizer = torch.optim.AdamW(module.parameters())
    start = time.perf_counter()
    DeepSpeedEngine._check_for_duplicates(types.SimpleNamespace(module=module), optimizer)
    return time.perf_counter() - start


# One save_state_dict row, run by ``python -c`` in a fresh process with the tree to time first on sys.path (the
# tree may be an older commit's, which has no such mode of its own). argv: tree, tensors, floats, repeat, root.
SAVE_JOB = """
import json, os, shutil, sys, time
sys.path.insert(0, os.path.abspath(sys.argv[1]))
import torch
import stagesafe
tensors, floats, repeat, root = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
state = {f"layers.{i}.weight": torch.randn(floats) for i in range(tensors)}
shutil.rmtree(root, ignore_errors=True)
seconds = []
for i in range(repeat):
    start = time.perf_counter()
    stagesafe.save_state_dict(state, os.path.join(root, "handoff"), overwrite=True)
    seconds.append(time.perf_counter() - start)
shutil.rmtree(root, ignore_errors=True)
print("SAVE " + json.dumps({"stagesafe": stagesafe.__file__, "seconds": seconds}), flush=True)
"""


# The floor: what any per-tensor boundary pays, by the libraries' own code and one Python step a tensor, in a fresh
# process. argv: tensors, floats, repeat, root. Best of ``repeat`` for each.
FLOOR_JOB = """
import json, os, shutil, sys, time
import torch
from torch import nn
from safetensors.torch import load_file, save_file
tensors, floats, repeat, root = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
module = nn.Module()
for i in range(tensors):
    module.register_parameter(f"p{i}", nn.Parameter(torch.randn(floats)))
os.makedirs(root, exist_ok=True)
path = os.path.join(root, "floor.safetensors")
state = {k: v.detach() for k, v in module.state_dict().items()}

def set_data():
    for p in module.parameters():
        p.data = p.data

steps = {
    "one .data assignment a parameter": set_data,
    "module.state_dict()": module.state_dict,
    "safetensors save_file": lambda: save_file(state, path),
    "safetensors load_file": lambda: load_file(path),
}
best = {}
for name, step in steps.items():
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    best[name] = min(seconds)
shutil.rmtree(root, ignore_errors=True)
print("FLOOR " + json.dumps(best), flush=True)
"""


def floor_table(args: argparse.Namespace) -> list[dict]:
    """The floor at each count beside the same bytes in ``--few`` tensors: each step's best seconds and ratio."""
    rows = []
    print(f"{'step':>36} {'tensors':>8} {'best s':>8} {'same bytes in few, s':>21} {'ratio':>7}")
    for tensors in args.counts:
        seen = {}
        for count in (tensors, args.few):
            floats = args.floats * tensors // count
            command = [sys.executable, "-c", FLOOR_JOB, str(count), str(floats), str(args.repeat),
                       os.path.join(args.root, "floor")]
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("FLOOR ")]
            if done.returncode != 0 or not lines:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"the floor at {count} tensors failed")
            seen[count] = json.loads(lines[0][6:])
        for step, seconds in seen[tensors].items():
            few = seen[args.few][step]
            rows.append({"step": step, "tensors": tensors, "seconds": seconds, "few_seconds": few})
            print(f"{step:>36} {tensors:>8} {seconds:8.4f} {few:21.4f} {seconds / max(few, 1e-9):7.0f}")
    return rows


def save_row(args: argparse.Namespace, tree: str, tensors: int, count: int) -> dict:
    """``save_state_dict`` of ``tensors`` tensors (or their bytes in ``count``) by the stagesafe of ``tree``."""
    floats = args.floats * tensors // count if count else args.floats
    command = [sys.executable, "-c", SAVE_JOB, tree, str(count or tensors), str(floats), str(args.repeat),
               os.path.join(args.root, "save")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tree)
    rows = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("SAVE ")]
    if done.returncode != 0 or not rows:
        print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"save_state_dict of {count or tensors} tensors from {tree} failed")
    return {"tree": os.path.realpath(tree), "tensors": tensors, "count": count or tensors, **rows[0]}


def show_saves(rows: list[dict], header: bool = True) -> None:
    if header:
        print(f"{'tree':>24} {'tensors':>8} {'first s':>8} {'median s':>9} {'best s':>8} {'best us/tensor':>15}")
    for row in rows:
        seconds = sorted(row["seconds"])
        median = seconds[len(seconds) // 2]
        print(f"{row['tree'][-24:]:>24} {row['count']:>8} {row['seconds'][0]:8.3f} {median:9.3f} {seconds[0]:8.3f} "
              f"{seconds[0] / row['count'] * 1e6:15.1f}")


def save_table(args: argparse.Namespace) -> list[dict]:
    """Every tree at every count, then at the same bytes in ``--few`` tensors, the trees interleaved."""
    rows = []
    for tensors in args.counts:
        for count in (0, args.few):
            for tree in args.trees:
                rows.append(save_row(args, tree, tensors, count))
                show_saves(rows[-1:], header=len(rows) == 1)
    return rows


def run_job(args: argparse.Namespace) -> None:
    """One arm over the sequence, in this process (and rank 1, which Lightning starts by re-running it)."""
    if args.linear_duplicate_check:
        from deepspeed.runtime.engine import DeepSpeedEngine

        DeepSpeedEngine._check_for_duplicates = linear_duplicate_check
    torch.manual_seed(0)
    floats = args.floats * args.tensors // args.count if args.count else args.floats
    module = ManyTensors(args.count or args.tensors, floats)
    data = DataLoader(TensorDataset(torch.randn(4, 16)), batch_size=2)
    rows: list[dict] = []
    strategy = None
    for call in SEQUENCE:
        if args.job == "stock":
            strategy = (pl.strategies.DeepSpeedStrategy if args.accelerator != "cpu" else CPUCapableDeepSpeedStrategy)(
                stage=3)
        else:
            strategy = stagesafe.StageSafeDeepSpeedStrategy(stage=3, handoff_uri=os.path.join(args.root, "handoff"),
                                                            overwrite_handoff=True)
        trainer = pl.Trainer(
            accelerator=args.accelerator, devices=2, strategy=strategy, precision="bf16-mixed", max_steps=1,
            limit_val_batches=1, limit_test_batches=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=args.root,
        )
        error = None
        with Window(rows, call):
            try:
                if call == "fit":
                    trainer.fit(module, train_dataloaders=data)
                else:
                    getattr(trainer, call)(module, dataloaders=data, verbose=False)
            except Exception as exc:  # noqa: BLE001 - stock's later calls fail: recorded, not raised
                error = f"{type(exc).__name__}: {str(exc)[:200]}"
        report = getattr(strategy, "last_boundary", None)
        rows[-1].update(error=error, enter=getattr(report, "enter_seconds", None),
                        leave=getattr(report, "seconds", None), phases=dict(getattr(report, "phases", {}) or {}))
        if error is not None:
            break
    if args.job == "stagesafe" and strategy is not None:
        strategy.wait_for_handoff()
    if trainer.global_rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)


def run_row(args: argparse.Namespace, job: str, tensors: int, count: int) -> list[dict]:
    """One job in fresh processes; its rank 0's rows."""
    command = [sys.executable, os.path.abspath(__file__), "--job", job, "--tensors", str(tensors),
               "--count", str(count), "--floats", str(args.floats), "--accelerator", args.accelerator,
               "--root", os.path.join(args.root, f"{job}-{tensors}-{count}")]
    if args.linear_duplicate_check:
        command.append("--linear-duplicate-check")
    done = subprocess.run(command, capture_output=True, text=True)
    rows = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if done.returncode != 0 or not rows:
        print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"the {job} job at {tensors} tensors failed (exit code {done.returncode})")
    return rows[0]


def show(table: list[tuple[str, int, int, list[dict]]]) -> None:
    print(f"{'arm':>9} {'tensors':>8} {'call':>8} {'wall s':>8} {'enter s':>8} {'leave s':>8} {'peak RSS GiB':>12}"
          "  leave's phases over 0.05 s / error")
    for job, tensors, count, rows in table:
        for row in rows:
            enter = f"{row['enter']:8.2f}" if row["enter"] is not None else f"{'':>8}"
            leave = f"{row['leave']:8.2f}" if row["leave"] is not None else f"{'':>8}"
            phases = ", ".join(f"{k} {v:.2f}" for k, v in row["phases"].items() if v > 0.05)
            print(f"{job:>9} {count or tensors:>8} {row['call']:>8} {row['seconds']:8.2f} {enter} {leave} "
                  f"{row['rss_peak'] / 2**30:12.2f}  {row['error'] or phases}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[20000, 70000], help="tensor counts of the table")
    parser.add_argument("--few", type=int, default=4, help="the baseline: the same bytes in this many tensors")
    parser.add_argument("--floats", type=int, default=16, help="floats per tensor (a multiple of 16)")
    parser.add_argument("--arms", nargs="*", default=["stock", "stagesafe"], choices=("stock", "stagesafe"))
    parser.add_argument("--floor", action="store_true",
                        help="time what any per-tensor boundary pays (library code, one Python step a tensor)")
    parser.add_argument("--save-state-dict", action="store_true",
                        help="time save_state_dict alone at --counts (and --few), each --trees' stagesafe")
    parser.add_argument("--trees", nargs="+", default=[os.path.dirname(HERE)],
                        help="source trees whose stagesafe --save-state-dict times (default: this one)")
    parser.add_argument("--repeat", type=int, default=3, help="saves per --save-state-dict row")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--linear-duplicate-check", action="store_true",
                        help="give both arms a linear check instead of DeepSpeed's quadratic one")
    parser.add_argument("--duplicate-check", action="store_true", help="only time DeepSpeed's check at --counts")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-bench-many-tensors"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--job", choices=("stock", "stagesafe"), help=argparse.SUPPRESS)
    parser.add_argument("--tensors", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        run_job(args)
        return
    if args.duplicate_check:
        for count in args.counts:
            print(f"DeepSpeedEngine._check_for_duplicates, {count} parameters: {time_duplicate_check(count):.2f} s")
        return
    floor = floor_table(args) if args.floor else []
    saves = save_table(args) if args.save_state_dict else []
    table = []
    for tensors in args.counts:
        for job in args.arms:
            for count in (0, args.few):  # N tensors, then the same bytes in few
                table.append((job, tensors, count, run_row(args, job, tensors, count)))
                show(table[-1:])
    print()
    if saves:
        show_saves(saves)
    if table:
        show(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "table": table, "saves": saves, "floor": floor}, f, indent=1)


if __name__ == "__main__":
    main()
    end_distributed_job()
