"""Benchmark: ``stagesafe consolidate`` against DeepSpeed's ``zero_to_fp32.py --safe_serialization``.

Both convert the same ZeRO-3 checkpoint (at least 1 GB on disk, built here with real DeepSpeed on CPU unless
``--checkpoint`` names one) to safetensors, each as its own subprocess, alternating, in one session. Measured:
wall time of the command, wall time until the output is on disk (the command, then ``sync``), and peak RSS
(``ru_maxrss`` of that one child, from ``os.wait4``); medians over the rounds. The cost of each tool's imports
is shown apart, measured the same way in the same rounds: ``zero_to_fp32.py --help`` (torch and DeepSpeed,
then exit) and ``python -c "import stagesafe.cli, stagesafe.consolidate"`` (what the command imports before it
reads a byte). The outputs are compared bit for bit at the end.

    python benchmarks/bench_consolidate.py                       # build a ~1.1 GB checkpoint, 3 rounds
    python benchmarks/bench_consolidate.py --checkpoint CKPT --repeat 5

Needs deepspeed and huggingface_hub (zero_to_fp32 shards with it); prints a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def build_checkpoint(workdir: str, hidden: int, layers: int) -> str:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from _launch import run_ranks

    out = os.path.join(workdir, "ckpt")
    script = os.path.join(REPO, "tests", "scripts", "make_zero_checkpoint.py")
    args = [
        out,
        "z3:stage=3,dtype=fp32",
        "--model",
        "big",
        "--hidden",
        str(hidden),
        "--layers",
        str(layers),
        "--steps",
        "1",
    ]
    run_ranks(script, args, world_size=2, timeout=1200)
    return os.path.join(out, "z3")


def measure(cmd: list[str], env: dict[str, str], cwd: str) -> dict[str, float]:
    """Run ``cmd``; its wall time, wall time including a ``sync`` of what it wrote, and its own peak RSS.

    Linux's ``ru_maxrss`` of a child counts the memory of this process at the fork (subprocess forks with
    vfork, and exec keeps the larger of the two high-water marks), so this process imports neither torch nor
    DeepSpeed before the rounds are over: its own RSS, about 20 MB, is the floor of every figure."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    stderr = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    os.sync()
    durable = time.perf_counter() - start
    rss_kib = usage.ru_maxrss if sys.platform != "darwin" else usage.ru_maxrss / 1024  # Linux: KiB; macOS: bytes
    return {"wall": wall, "durable": durable, "rss_mb": rss_kib * 1024 / 1e6}


def compare_outputs(z2f_dir: str, ours_dir: str) -> str:
    import torch
    from safetensors.torch import load_file

    from stagesafe.handoff.read import load_state_dict

    theirs: dict = {}
    for name in sorted(os.listdir(z2f_dir)):
        if name.endswith(".safetensors"):
            theirs.update(load_file(os.path.join(z2f_dir, name)))
    ours = load_state_dict(ours_dir)
    if set(theirs) != set(ours):
        return f"DIFFERENT names: {sorted(set(theirs) ^ set(ours))[:5]}"
    bad = [k for k in theirs if theirs[k].dtype != ours[k].dtype or not torch.equal(theirs[k], ours[k])]
    return f"identical ({len(ours)} tensors)" if not bad else f"DIFFERENT values: {bad[:5]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="an existing ZeRO checkpoint folder (default: build one)")
    parser.add_argument("--hidden", type=int, default=2048, help="built model: width of each square layer")
    parser.add_argument("--layers", type=int, default=22, help="built model: layers (2048 x 22: 92M params, 1.1 GB)")
    parser.add_argument("--repeat", type=int, default=3, help="measured rounds, after one warm-up round")
    parser.add_argument("--max-shard-size", default="5GB", help="given to both tools")
    parser.add_argument("--workdir", help="where to build and write (default: a temporary folder, removed)")
    parser.add_argument(
        "--stagesafe-path",
        default=REPO,
        help="folder to import stagesafe from (default: this checkout), to compare versions",
    )
    args = parser.parse_args()

    workdir = args.workdir or tempfile.mkdtemp(prefix="stagesafe-bench-")
    os.makedirs(workdir, exist_ok=True)
    try:
        ckpt = args.checkpoint or build_checkpoint(workdir, args.hidden, args.layers)
        size = folder_bytes(ckpt)
        if size < 1e9:
            print(
                f"warning: the checkpoint is {size / 1e9:.2f} GB, under the 1 GB the comparison asks for",
                file=sys.stderr,
            )
        pythonpath = os.pathsep.join(p for p in (args.stagesafe_path, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": pythonpath}
        # The script DeepSpeed copies next to every checkpoint; run from a folder of its own, since its package
        # folder holds a types.py that would shadow the standard library's. Found without importing deepspeed:
        # this process stays small until the rounds are done (see measure()).
        spec = importlib.util.find_spec("deepspeed")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("deepspeed is not installed")
        z2f_script = os.path.join(workdir, "zero_to_fp32.py")
        shutil.copyfile(os.path.join(spec.submodule_search_locations[0], "utils", "zero_to_fp32.py"), z2f_script)
        runs: dict[str, list[dict[str, float]]] = {"zero_to_fp32": [], "stagesafe": []}
        outs = {"zero_to_fp32": os.path.join(workdir, "out-z2f"), "stagesafe": os.path.join(workdir, "out-stagesafe")}
        commands = {
            "zero_to_fp32": lambda out: [
                sys.executable,
                z2f_script,
                ckpt,
                out,
                "--safe_serialization",
                "--max_shard_size",
                args.max_shard_size,
            ],
            "stagesafe": lambda out: [
                sys.executable,
                "-m",
                "stagesafe.cli",
                "consolidate",
                ckpt,
                out,
                "--max-shard-size",
                args.max_shard_size,
                "-q",
            ],
        }
        imports = {
            "zero_to_fp32 imports": [sys.executable, z2f_script, "--help"],
            "stagesafe imports": [sys.executable, "-c", "import stagesafe.cli, stagesafe.consolidate"],
        }
        runs.update({name: [] for name in imports})
        for round_ in range(args.repeat + 1):
            order = ["zero_to_fp32", "stagesafe"] if round_ % 2 == 0 else ["stagesafe", "zero_to_fp32"]
            for tool in order:
                shutil.rmtree(outs[tool], ignore_errors=True)
                result = measure(commands[tool](outs[tool]), env, cwd=workdir)  # not the checkout: PYTHONPATH decides
                if round_ > 0:  # round 0 warms the page cache and the imports
                    runs[tool].append(result)
                print(
                    f"round {round_} {tool:13s} wall {result['wall']:.2f} s  durable {result['durable']:.2f} s  peak RSS {result['rss_mb']:.0f} MB",
                    file=sys.stderr,
                )
            for name in order:
                result = measure(imports[f"{name} imports"], env, cwd=workdir)
                if round_ > 0:
                    runs[f"{name} imports"].append(result)
                print(
                    f"round {round_} {name} imports only: wall {result['wall']:.2f} s  peak RSS {result['rss_mb']:.0f} MB",
                    file=sys.stderr,
                )
        same = compare_outputs(outs["zero_to_fp32"], outs["stagesafe"])

        def med(tool: str, key: str) -> float:
            return statistics.median(r[key] for r in runs[tool])

        import deepspeed
        import torch

        out_bytes = folder_bytes(outs["stagesafe"])
        print(f"checkpoint: {ckpt} ({size / 1e9:.2f} GB on disk), output {out_bytes / 1e6:.0f} MB, outputs {same}")
        print(
            f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
            f"torch {torch.__version__}, deepspeed {deepspeed.__version__}; median of {args.repeat} rounds\n"
        )
        print("| tool | wall (s) | wall until synced (s) | peak RSS (MB) | largest peak RSS (MB) |")
        print("|---|---:|---:|---:|---:|")
        for tool in ("zero_to_fp32", "stagesafe"):
            print(
                f"| {tool} | {med(tool, 'wall'):.2f} | {med(tool, 'durable'):.2f} | {med(tool, 'rss_mb'):.0f} | "
                f"{max(r['rss_mb'] for r in runs[tool]):.0f} |"
            )
        print(
            f"| **ratio** stagesafe / zero_to_fp32 | **{med('stagesafe', 'wall') / med('zero_to_fp32', 'wall'):.2f}** | "
            f"**{med('stagesafe', 'durable') / med('zero_to_fp32', 'durable'):.2f}** | "
            f"**{med('stagesafe', 'rss_mb') / med('zero_to_fp32', 'rss_mb'):.2f}** | "
            f"{max(r['rss_mb'] for r in runs['stagesafe']) / max(r['rss_mb'] for r in runs['zero_to_fp32']):.2f} |"
        )
        print("\nimports alone (included in the rows above):\n")
        print("| imports of | wall (s) | peak RSS (MB) |")
        print("|---|---:|---:|")
        for name in imports:
            print(f"| {name.removesuffix(' imports')} | {med(name, 'wall'):.2f} | {med(name, 'rss_mb'):.0f} |")
        reproduce = " ".join(["python", "benchmarks/bench_consolidate.py", *sys.argv[1:]])
        print(f"\nreproduce: {reproduce}")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
