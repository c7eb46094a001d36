"""Load throughput of ``stagesafe.load_state_dict`` against ``safetensors.torch.load_file`` on the same files.

Reproduce:  python benchmarks/bench_load.py --gb 2 --shard 500MB

Writes a handoff of about ``--gb`` GB of fp32 tensors, then, alternating, loads it with stagesafe (which checks
every shard's size and sha256 against the manifest before deserialising) and with ``load_file`` on each shard
(no check), materialising every tensor (a sum over it) so lazy mapping cannot flatter either side.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import load_file

import stagesafe


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
    stagesafe.save_state_dict(state, uri, max_shard_size=args.shard)
    nbytes = sum(t.nbytes for t in state.values())
    del state
    shards = sorted(glob.glob(os.path.join(uri, "*.safetensors")))
    ours, theirs = [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        touch(stagesafe.load_state_dict(uri))
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        loaded = {}
        for shard in shards:
            loaded.update(load_file(shard))
        touch(loaded)
        theirs.append(time.perf_counter() - start)
        del loaded
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"\n{nbytes / 1e9:.2f} GB fp32 in {len(shards)} shards; median of {args.repeat}; torch {torch.__version__}\n")
    print("| loader | seconds | GB/s | throughput vs load_file |")
    print("| --- | --- | --- | --- |")
    print(f"| safetensors.torch.load_file, shard by shard | {b:.3f} | {nbytes / b / 1e9:.2f} | 1.00x |")
    print(f"| stagesafe.load_state_dict (sha256-verified) | {a:.3f} | {nbytes / a / 1e9:.2f} | {b / a:.2f}x |")
    print(f"\nreproduce: python benchmarks/bench_load.py --gb {args.gb} --shard {args.shard} --repeat {args.repeat}")


if __name__ == "__main__":
    main()
