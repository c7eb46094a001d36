"""Benchmark: putting a ZeRO checkpoint into an engine, stagesafe's re-partitioning load against DeepSpeed's own.

A checkpoint of ``tests/scripts/make_zero_checkpoint.py``'s big model (``--hidden`` x ``--hidden`` x ``--layers``
parameters, AdamW after 2 steps) is saved by ``--saved`` CPU ranks (gloo), then loaded into a new engine by
``tests/scripts/plain_resume.py``: with stagesafe (``read_rank_files`` + ``load_rank_files``) at each world size of
``--resumed``, and with DeepSpeed's ``engine.load_checkpoint`` at the world size that saved (the only one it
loads). Each load is its own job; measured: the load's wall time on rank 0 (both timed from a barrier to a
barrier, stagesafe's modules imported before the clock in both) and rank 0's peak RSS for the whole process
(engine included). Medians over ``--repeat`` rounds, stock and stagesafe in turns within each round.

    python benchmarks/bench_resume.py --stage 3 --hidden 2048 --layers 8 --saved 2 --resumed 1 2 3
    python benchmarks/bench_resume.py --stage 1 --dtype bf16 --hidden 2048 --layers 8

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
SCRIPT = os.path.join(REPO, "tests", "scripts", "plain_resume.py")


def run(phase: str, out: str, args: argparse.Namespace, ranks: int) -> dict:
    from _launch import run_ranks

    argv = [phase, out, str(args.stage), "--model", "big", "--hidden", str(args.hidden), "--layers",
            str(args.layers), "--dtype", args.dtype, "--no-record"]
    results = run_ranks(SCRIPT, argv, world_size=ranks, timeout=1800, env={"PYTHONPATH": REPO})
    done = [line for line in results[0].stdout.splitlines() if line.startswith("DONE ")]
    return json.loads(done[-1][len("DONE "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: the engine trains in bf16 (ZeRO-1 under bf16 is DeepSpeed's BF16_Optimizer)")
    parser.add_argument("--saved", type=int, default=2)
    parser.add_argument("--resumed", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", default=None, help="where the checkpoint is written (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-resume-", dir=args.root) as out:
        run("save", out, args, args.saved)
        rows: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.repeat):
            rows.setdefault(("deepspeed load_checkpoint", args.saved), []).append(run("stock", out, args, args.saved))
            for ranks in args.resumed:
                rows.setdefault(("stagesafe", ranks), []).append(run("ours", out, args, ranks))
    params = args.hidden * (args.hidden + 1) * args.layers
    print(f"ZeRO-{args.stage}, {params / 1e6:.1f}M parameters ({args.dtype}, AdamW), saved by {args.saved} CPU ranks; "
          f"medians of {args.repeat}\n")
    print("| load | ranks | seconds | rank 0 peak RSS (MiB) |")
    print("| --- | --- | --- | --- |")
    for (who, ranks), runs in rows.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        peak = statistics.median(r["peak_rss_mib"] for r in runs)
        print(f"| {who} | {ranks} | {seconds:.2f} | {peak:.0f} |")


if __name__ == "__main__":
    main()
