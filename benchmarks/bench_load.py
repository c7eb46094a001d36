"""Load throughput of ``stagesafe.load_state_dict`` against ``safetensors.torch.load_file`` on the same files.

Reproduce:  python benchmarks/bench_load.py --gb 2 --shard 500MB

Writes a handoff of about ``--gb`` GB of fp32 tensors, then, in turns, loads it with ``load_file`` on each shard
(no check) and three ways with stagesafe: as a process that has not hashed the shards yet (every byte hashed
against the manifest's sha256 while it is read), as the process that wrote them (unchanged files are mapped,
as load_file does), and with ``verify=False``. Every tensor is summed after loading, so lazy mapping cannot
flatter either side.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import statistics
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import stagesafe  # noqa: E402


def touch(state: dict) -> float:
    return float(sum(t.float().sum() for t in state.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--shard", default="500MB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-bench-load"))
    args = parser.parse_args()
    n = int(args.gb * 1e9 / 4 / 2**22)
    state = {f"layer{i}.weight": torch.randn(2**11, 2**11) for i in range(n)}
    uri = os.path.join(args.root, "handoff")
    stagesafe.save_state_dict(state, uri, max_shard_size=args.shard, overwrite=True)
    nbytes = sum(t.nbytes for t in state.values())
    del state
    shards = sorted(glob.glob(os.path.join(uri, "*.safetensors")))

    def forget_hashes() -> None:
        for shard in shards:  # a new change time: the file is no longer the one this process hashed
            os.utime(shard)

    def ours_hashing() -> None:
        forget_hashes()
        touch(stagesafe.load_state_dict(uri))

    def theirs() -> None:
        loaded = {}
        for shard in shards:
            loaded.update(load_file(shard))
        touch(loaded)

    variants = {
        "safetensors.torch.load_file, shard by shard": theirs,
        "stagesafe.load_state_dict, first load (sha256 of every byte)": ours_hashing,
        "stagesafe.load_state_dict, shards this process wrote or hashed": lambda: touch(stagesafe.load_state_dict(uri)),
        "stagesafe.load_state_dict(verify=False)": lambda: touch(stagesafe.load_state_dict(uri, verify=False)),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["safetensors.torch.load_file, shard by shard"]
    print(f"\n{nbytes / 1e9:.2f} GB fp32 in {len(shards)} shards; median of {args.repeat}; torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs\n")
    print("| loader (every tensor summed after loading) | seconds | GB/s | throughput vs load_file |")
    print("| --- | --- | --- | --- |")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.3f} | {nbytes / seconds / 1e9:.2f} | {base / seconds:.2f}x |")
    probe = bytes(256 << 20)
    start = time.perf_counter()
    hashlib.sha256(probe).digest()
    print(f"\nsha256 on one core: {len(probe) / (time.perf_counter() - start) / 1e9:.2f} GB/s")
    print(f"\nreproduce: python benchmarks/bench_load.py --gb {args.gb} --shard {args.shard} --repeat {args.repeat}")


if __name__ == "__main__":
    main()
