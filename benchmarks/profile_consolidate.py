"""Where the time and memory of ``stagesafe consolidate`` go on this machine.

    python benchmarks/profile_consolidate.py --hidden 4096 --layers 22     # builds a 4.4 GB checkpoint
    python benchmarks/profile_consolidate.py --checkpoint CKPT

Each measurement is its own subprocess (wall time, and peak RSS from ``os.wait4``), after one warm-up run:
- ``import torch`` alone, then ``import stagesafe.cli`` (what the command loads before reading anything);
- the command itself, with the default 5 GB shard limit and with a 512 MB one (several shards, hashed and
  written by several threads);
- sha256 of 1 GB in one thread, the rate that bounds a shard (every shard is hashed as one stream);
- a cProfile of the Python API ``stagesafe.consolidate``, imports excluded (the top entries by cumulative time).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time

from bench_consolidate import REPO, build_checkpoint, folder_bytes, measure

_PROFILE = """
import cProfile, pstats, sys
import stagesafe
profiler = cProfile.Profile()
profiler.runcall(stagesafe.consolidate, sys.argv[1], sys.argv[2], progress=False)
pstats.Stats(profiler).sort_stats("cumulative").print_stats(22)
"""


def sha256_rate(nbytes: int = 1 << 30) -> float:
    data = os.urandom(nbytes)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return nbytes / (time.perf_counter() - start) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="an existing ZeRO checkpoint folder (default: build one)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="stagesafe-profile-")
    try:
        ckpt = args.checkpoint or build_checkpoint(workdir, args.hidden, args.layers)
        pythonpath = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": pythonpath}
        out = os.path.join(workdir, "out")
        py = sys.executable
        cli = [py, "-m", "stagesafe.cli", "consolidate", ckpt, out, "-q", "--overwrite"]
        runs = {
            "import torch": [py, "-c", "import torch"],
            "import stagesafe.cli": [py, "-c", "import stagesafe.cli"],
            "stagesafe consolidate (5GB shards)": cli,
            "stagesafe consolidate --max-shard-size 512MB": [*cli, "--max-shard-size", "512MB"],
        }
        print(f"checkpoint: {ckpt} ({folder_bytes(ckpt) / 1e9:.2f} GB on disk)")
        for label, cmd in runs.items():
            measure(cmd, env, cwd=workdir)  # warm-up: page cache, bytecode
            result = measure(cmd, env, cwd=workdir)
            extra = f"; output {folder_bytes(out) / 1e9:.2f} GB" if "consolidate" in label else ""
            print(f"{label}: wall {result['wall']:.2f} s, peak RSS {result['rss_mb']:.0f} MB{extra}")
            shutil.rmtree(out, ignore_errors=True)
        print(f"sha256 in one thread: {sha256_rate():.2f} GB/s")
        print("cProfile of stagesafe.consolidate (imports excluded):", flush=True)
        import subprocess

        subprocess.run([py, "-c", _PROFILE, ckpt, out], env=env, cwd=workdir, check=True)
        print(f"\nreproduce: python benchmarks/profile_consolidate.py --hidden {args.hidden} --layers {args.layers}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
