"""A long fuzz run of the readers on hostile files: safetensors headers, handoffs, ZeRO rank files and their pickles.

Reproduce:  nice python benchmarks/fuzz_hostile.py 900            # 15 minutes, shared among the 4 targets
            python benchmarks/fuzz_hostile.py 60 --target handoff  # one target
            python benchmarks/fuzz_hostile.py 60 --seed 7          # the same cases as a run that printed seed 7

The targets and their properties are those of ``tests/_fuzz.py`` (the test suite runs a few derandomized
examples of each; this runs random ones for as long as it is given). Each target runs in a process of its own,
batch after batch with a new seed, and writes every case to a file before running it: a crash (SIGSEGV,
SIGBUS), a hang (a case past ``tests/_fuzz.py``'s ``CASE_TIMEOUT``: the process dumps its threads and exits) or
a broken property stops that target and prints the case. The output is the count of cases per target and
outcome, and every failure; the exit code is 1 if there was any.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TARGETS = ("header", "handoff", "rank_files", "pickles")
BATCH = 100  # examples per hypothesis run; each run draws a new seed


def child(target: str, seconds: float, case_log: str, seed: int | None = None) -> int:
    """Run batches of ``target`` until ``seconds`` have passed; print one ``COUNTS {...}`` line per batch.
    ``seed``: the first batch's (then one more per batch); by default a random one."""
    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    logging.getLogger("stagesafe").setLevel(logging.ERROR)  # interrupted-save notices, by design, are expected
    import _fuzz
    import stagesafe

    print(f"STAGESAFE {os.path.dirname(stagesafe.__file__)}", flush=True)

    def log(case: str) -> None:
        with open(case_log, "w") as f:
            f.write(case)

    deadline = time.monotonic() + seconds
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    print(f"SEED {seed}", flush=True)
    while time.monotonic() < deadline:
        counts = _fuzz.run(target, examples=BATCH, derandomize=False, seed=seed, log=log)
        print("COUNTS " + json.dumps(counts), flush=True)
        seed += 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("seconds", type=float, help="time budget for the whole run, shared among the targets")
    parser.add_argument("--target", action="append", choices=TARGETS, help="run only these (repeatable)")
    parser.add_argument("--seed", type=int, help="the first batch's seed, for a run that repeats (default: random)")
    parser.add_argument("--child", choices=TARGETS, help=argparse.SUPPRESS)
    parser.add_argument("--case-log", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.seconds, args.case_log, args.seed)

    targets = args.target or list(TARGETS)
    share = args.seconds / len(targets)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    failures = 0
    print(f"fuzz_hostile: {args.seconds:g} s over {', '.join(targets)} ({share:g} s each)", flush=True)
    for target in targets:
        case_log = os.path.join(tempfile.mkdtemp(prefix="stagesafe-fuzz-"), "case.txt")
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), str(share), "--child", target, "--case-log", case_log,
             *(["--seed", str(args.seed)] if args.seed is not None else [])],
            env=env,
            capture_output=True,
            text=True,
            timeout=share + 600,  # a batch started near the deadline finishes; a hang exits by itself
            check=False,
        )
        totals: dict[str, int] = {}
        for line in proc.stdout.splitlines():
            if line.startswith("STAGESAFE ") and target == targets[0]:
                print(f"stagesafe from {line.split(' ', 1)[1]}", flush=True)
            if line.startswith("SEED "):
                print(f"{target}: first seed {line.split(' ', 1)[1]} (--seed repeats the run)", flush=True)
            if line.startswith("COUNTS "):
                for outcome, n in json.loads(line[len("COUNTS ") :]).items():
                    totals[outcome] = totals.get(outcome, 0) + n
        cases = sum(totals.values())
        took = time.monotonic() - started
        print(f"{target}: {cases} cases in {took:.0f} s {json.dumps(totals, sort_keys=True)}", flush=True)
        if proc.returncode != 0:
            failures += 1
            code = proc.returncode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            case = open(case_log).read() if os.path.exists(case_log) else "(none logged)"
            print(f"{target}: FAILED ({how}); last case: {case[:2000]}", flush=True)
            print(proc.stderr[-6000:], flush=True)
    print("fuzz_hostile: " + ("no failure" if not failures else f"{failures} target(s) failed"), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
