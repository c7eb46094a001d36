"""Lightning's own DeepSpeed tests against the stock strategy and against stagesafe's, on this machine.

    python scripts/lightning_suite.py SUITE_DIR OUT_DIR                    # the tests that need no GPU
    python scripts/lightning_suite.py SUITE_DIR OUT_DIR --gpus 2 --modes stagesafe stock \
        --standalone test_a test_b ... --budget 540                        # standalone (GPU) tests

SUITE_DIR holds Lightning's test file and a harness that puts StageSafeDeepSpeedStrategy in place of the stock
class (its ``run_suite.sh``, which runs the CPU part here). Standalone tests run one per process, as
Lightning's CI runs them; on a host of 2 GPUs, two tests that need one GPU run at once, each on its own GPU.
Exits 1 when stagesafe fails a test that stock passes, 0 otherwise, and prints the side-by-side table.
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


def gpus_needed(suite: str) -> dict[str, int]:
    """Test function -> GPUs it asks for (``@RunIf(min_cuda_gpus=N)`` above its ``def``)."""
    import re

    path = os.path.join(suite, "upstream", "tests_pytorch", "strategies", "test_deepspeed.py")
    with open(path) as f:
        source = f.read()
    needed, pending = {}, None
    for line in source.splitlines():
        if (found := re.search(r"min_cuda_gpus=(\d+)", line)) and line.lstrip().startswith("@RunIf"):
            pending = int(found.group(1))
        elif (name := re.match(r"def (test_\w+)", line)) is not None:
            needed[name.group(1)] = pending or 0
            pending = None
    return needed


def run_standalone(suite: str, out: str, jobs: list[tuple[str, str]], *, gpus: int, budget: float) -> dict:
    """Run ``(mode, test)`` jobs, one pytest process each; on 2 GPUs, 1-GPU jobs two at a time. Returns
    {(mode, test): (outcome, seconds, log)}; jobs that would start past ``budget`` seconds are "not run"."""
    import time

    suite, out = os.path.abspath(suite), os.path.abspath(out)
    needed = gpus_needed(suite)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    upstream = os.path.join(suite, "upstream")
    testfile = os.path.join(upstream, "tests_pytorch", "strategies", "test_deepspeed.py")
    started, results, running = time.monotonic(), {}, []
    queue = sorted(jobs, key=lambda j: -needed.get(j[1].split("[")[0], 2))  # 2-GPU jobs, then 1-GPU ones in pairs
    port = 14000
    while queue or running:
        free = gpus - sum(job["gpus"] for job in running)
        for job in list(running):
            if job["proc"].poll() is not None:
                log = open(job["log"]).read()
                outcome = next((w for w in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL") if f"\n{w} " in log
                                or log.startswith(f"{w} ")), f"exit {job['proc'].returncode}")
                results[job["key"]] = (outcome.lower(), round(time.monotonic() - job["t0"]), job["log"])
                running.remove(job)
                free += job["gpus"]
        while queue:
            mode, test = queue[0]
            want = min(max(needed.get(test.split("[")[0], 2), 1), gpus)
            if want > free or (want == 2 and running):
                break
            queue.pop(0)
            if time.monotonic() - started > budget:
                results[(mode, test)] = ("not run: budget", 0, "")
                continue
            devices = [g for g in range(gpus) if g not in {d for j in running for d in j["devices"]}][:want]
            port += 20
            log = os.path.join(out, f"{mode}-{test.replace('[', '_').replace(']', '')}.log")
            env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
            env.update(SUITE_MODE=mode, PL_RUN_STANDALONE_TESTS="1", PL_USE_MOCKED_MNIST="1", STANDALONE_PORT=str(port),
                       CUDA_VISIBLE_DEVICES=",".join(map(str, devices)), PYTHONDONTWRITEBYTECODE="1",
                       PYTHONPATH=os.pathsep.join([os.path.join(suite, "harness"), upstream, repo, env.get("PYTHONPATH", "")]))
            workdir = os.path.join(out, "work", f"{mode}-{port}")
            os.makedirs(workdir, exist_ok=True)
            command = [sys.executable, "-m", "pytest", "-c", os.path.join(suite, "pytest.ini"), "-p", "no:cacheprovider",
                       "-p", "swap_plugin", "-q", "-rA", "-W", "default::FutureWarning", "--rootdir", upstream,
                       "--timeout", "150", f"{testfile}::{test}"]
            proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
            running.append({"key": (mode, test), "proc": proc, "gpus": want, "devices": devices, "log": log,
                            "t0": time.monotonic()})
            free -= want
        time.sleep(0.5)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite")
    parser.add_argument("out")
    parser.add_argument("--standalone", nargs="*", default=None, help="standalone (GPU) tests to run")
    parser.add_argument("--modes", nargs="+", default=["stock", "stagesafe"])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds after which no test is started")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.standalone is not None:
        jobs = [(mode, test) for test in args.standalone for mode in args.modes]
        results = run_standalone(args.suite, args.out, jobs, gpus=args.gpus, budget=args.budget)
        with open(os.path.join(args.out, "standalone.json"), "w") as f:
            json.dump({f"{m}::{t}": r for (m, t), r in results.items()}, f, indent=1)
        print(f"{'test':62s} " + " ".join(f"{m:>18s}" for m in args.modes))
        for test in args.standalone:
            cells = [f"{results[(m, test)][0]:>12s} {results[(m, test)][1]:4d}s" for m in args.modes]
            print(f"{test:62s} " + " ".join(cells))
        return 0
    stock = run_mode(args.suite, args.out, "stock", "")
    ours = run_mode(args.suite, args.out, "stagesafe", "")
    worse = [t for t, outcome in stock.items() if outcome == "passed" and ours.get(t) != "passed"]
    print(f"{'stock':10s} {'stagesafe':10s} test")
    for test in sorted(set(stock) | set(ours)):
        print(f"{stock.get(test, '-'):10s} {ours.get(test, '-'):10s} {test}{'   <- worse' if test in worse else ''}")
    print(f"\n{sum(o == 'passed' for o in stock.values())} passed with stock, "
          f"{sum(o == 'passed' for o in ours.values())} with stagesafe; {len(worse)} passed with stock only")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
