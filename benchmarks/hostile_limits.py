"""Time and peak memory of ``stagesafe consolidate`` on each crafted rank file of issue 25, as docs/reliability.md
reports them.

Reproduce:  DS_ACCELERATOR=cpu python benchmarks/hostile_limits.py --repeat 3

Each file (``tests/_hostile.py``: ``HOSTILE_RANK_FILES``) replaces rank 0's optimizer file of a small ZeRO-3
checkpoint in DeepSpeed's layout; ``stagesafe consolidate`` runs on it in a fresh process, which reports its exit
code, the seconds ``main()`` took (imports excluded) and its peak RSS (the kernel's VmHWM, imports included).
``tests/test_crafted_checkpoints.py`` asserts the exit code and the memory bound on the same files.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per file; the table gives the median")
    args = parser.parse_args()

    import torch
    from _hostile import HOSTILE_RANK_FILES, consolidate_measured, write_zero_checkpoint

    print(f"{'file':34s} {'bytes':>10s} {'exit':>4s} {'seconds':>8s} {'peak RSS MB':>11s}")
    for name, damage in HOSTILE_RANK_FILES.items():
        with tempfile.TemporaryDirectory() as folder:
            src = write_zero_checkpoint(os.path.join(folder, "ckpt"), {"w": torch.arange(6.0)})
            victim = os.path.join(src, "global_step1", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
            damage(victim)
            runs = [consolidate_measured(src, os.path.join(folder, f"out{i}")) for i in range(args.repeat)]
            codes = sorted({code for code, *_ in runs})
            seconds = statistics.median(s for _, s, _, _ in runs)
            rss = statistics.median(r for _, _, r, _ in runs)
            exits = ",".join(map(str, codes))
            print(f"{name:34s} {os.path.getsize(victim):>10d} {exits:>4s} {seconds:8.2f} {rss:11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
