"""Run the Trainer-sequence cases (stock vs stagesafe) and print them as a Markdown table.

Reproduce on two GPUs:   python benchmarks/stage_matrix.py run --accelerator gpu --out /tmp/matrix
Reproduce on the CPU:    python benchmarks/stage_matrix.py run --accelerator cpu --out /tmp/matrix
Print a table:           python benchmarks/stage_matrix.py table /tmp/matrix/*.rank0.json

Each group (stock/stagesafe x pair matrix/scenarios) runs as its own 2-process Lightning script under a
timeout, so a stock failure that hangs one group cannot take the others with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "tests", "scripts", "trainer_sequences.py")


def run(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(HERE, ".."), env.get("PYTHONPATH", "")) if p)
    if args.accelerator == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "1")
    for strategy in args.strategies:
        for kind in ("matrix", "scenario"):
            name = f"{strategy}-{kind}"
            spec = {
                "accelerator": args.accelerator,
                "devices": args.devices,
                "root": os.path.join(args.out, name),
                "case_groups": [{"kind": kind, "strategy": strategy, "precision": args.precision}],
            }
            spec_path = os.path.join(args.out, f"{name}.spec.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            start = time.perf_counter()
            with open(os.path.join(args.out, f"{name}.log"), "w") as log:
                try:
                    proc = subprocess.run(
                        [sys.executable, SCRIPT, spec_path, os.path.join(args.out, name)],
                        env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, start_new_session=True,
                    )
                    status = f"exit {proc.returncode}"
                except subprocess.TimeoutExpired:
                    status = "TIMED OUT"
            print(f"{name}: {status} in {time.perf_counter() - start:.1f}s", flush=True)
    return 0


def _cell(stage: dict) -> str:
    if stage["error"]:
        return "crash: " + stage["error"].split("\n")[0][:90].replace("|", "/")
    p = stage["probe"]
    parts = []
    if p["min_numel"] == 0:
        parts.append("hollow")
    if p["ds_attrs"]:
        parts.append(f"{p['ds_attrs']} ds_*")
    deepspeed_hooks = p.get("deepspeed_hooks", p["forward_hooks"] - 1)  # older records: the toy registers 1 hook
    if deepspeed_hooks > 0:
        parts.append(f"{deepspeed_hooks} DeepSpeed hooks")
    return "ok, clean" if not parts else "ok, " + ", ".join(parts)


def table(paths: list[str]) -> int:
    print("| case | stages | after each stage |")
    print("| --- | --- | --- |")
    for path in paths:
        with open(path) as f:
            results = json.load(f)
        for name, result in results.items():
            stages = " > ".join(s["stage"] for s in result["stages"])
            cells = "; ".join(f"{s['stage']}: {_cell(s)}" for s in result["stages"])
            print(f"| {name} | {stages} | {cells} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--accelerator", default="gpu")
    r.add_argument("--devices", type=int, default=2)
    r.add_argument("--precision", default="bf16-mixed")
    r.add_argument("--strategies", nargs="+", default=["stock", "stagesafe"])
    r.add_argument("--timeout", type=float, default=240)
    r.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    return run(args) if args.command == "run" else table(args.paths)


if __name__ == "__main__":
    sys.exit(main())
