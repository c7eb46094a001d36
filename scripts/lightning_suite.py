"""Lightning's own DeepSpeed tests against the stock strategy and against stagesafe's, on this machine.

    python scripts/lightning_suite.py SUITE_DIR OUT_DIR [--standalone "test_a test_b"]

SUITE_DIR holds Lightning's test file and a harness that puts StageSafeDeepSpeedStrategy in place of the stock
class (its ``run_suite.sh``). Without ``--standalone`` only the tests that need no GPU run. Exits 1 when
stagesafe fails a test that stock passes (or the harness could not make the swap), 0 otherwise, and prints
the side-by-side table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def run_mode(suite: str, out: str, mode: str, standalone: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env.update(MODE=mode, OUT=out, PYTHON=sys.executable, TESTS=standalone or " ",
               PYTHONPATH=os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p))
    env.pop("DS_ACCELERATOR", None)  # as a user's shell has it: Lightning's own CPU refusal is one of the tests
    proc = subprocess.run(["bash", os.path.join(suite, "run_suite.sh")], env=env, capture_output=True, text=True)
    with open(os.path.join(out, f"run_suite_{mode}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"run_suite.sh MODE={mode} exited {proc.returncode}; see {out}/run_suite_{mode}.log")
    with open(os.path.join(out, mode, "summary.json")) as f:
        summary = json.load(f)
    # a test parametrized by the strategy class is named after the class that stands in for it
    return {
        r["test"].rsplit("::", 1)[-1].replace("StageSafeDeepSpeedStrategy", "DeepSpeedStrategy"): r["outcome"]
        for r in summary["results"]
        if r["phase"] != "probe"
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite")
    parser.add_argument("out")
    parser.add_argument("--standalone", default="", help="standalone (GPU) tests to run too, space-separated")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    stock = run_mode(args.suite, args.out, "stock", args.standalone)
    ours = run_mode(args.suite, args.out, "stagesafe", args.standalone)
    worse = [t for t, outcome in stock.items() if outcome == "passed" and ours.get(t) != "passed"]
    print(f"{'stock':10s} {'stagesafe':10s} test")
    for test in sorted(set(stock) | set(ours)):
        print(f"{stock.get(test, '-'):10s} {ours.get(test, '-'):10s} {test}{'   <- worse' if test in worse else ''}")
    print(f"\n{sum(o == 'passed' for o in stock.values())} passed with stock, "
          f"{sum(o == 'passed' for o in ours.values())} with stagesafe; {len(worse)} passed with stock only")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
