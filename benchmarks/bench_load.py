"""Load throughput of ``stagesafe.load_state_dict`` against ``safetensors.torch.load_file`` on the same files.

Reproduce:  python benchmarks/bench_load.py --gb 1 --shard 250MB --repeat 5

Writes one handoff of about ``--gb`` GB of fp32 tensors per digest (``--digests``), then times, each in a fresh
process (imports excluded, files in the page cache for every loader alike):
- ``load_file`` on each shard of the handoff (no check);
- a first load with ``stagesafe.load_state_dict``: every byte of every shard hashed against the manifest, as in
  ``resume_from``, ``restore`` or ``stagesafe verify`` of a handoff another process wrote;
- a second load in that same process (its shards hashed already and unchanged: mapped, as ``load_file`` does);
- ``verify=False`` (sizes and headers checked, no hash).
Every tensor is summed after loading, so a lazy mapping cannot flatter either side. The processes run in turns,
the order reversed every round; the table gives the median of ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOAD_FILE = "safetensors.torch.load_file, shard by shard"


def touch(state: dict) -> float:
    return float(sum(t.float().sum() for t in state.values()))


def child(how: str, uri: str) -> None:
    """One measurement in this fresh process: print the seconds of each load as JSON."""
    import torch  # noqa: F401  (imported before the clock starts, as by any trainer)
    from safetensors.torch import load_file

    sys.path.insert(0, os.path.join(_HERE, ".."))
    import stagesafe

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    if how == "load_file":
        shards = sorted(glob.glob(os.path.join(uri, "*.safetensors")))

        def theirs() -> None:
            loaded = {}
            for shard in shards:
                loaded.update(load_file(shard))
            touch(loaded)

        print(json.dumps([timed(theirs)]))
    elif how == "verify=False":
        print(json.dumps([timed(lambda: touch(stagesafe.load_state_dict(uri, verify=False)))]))
    else:
        first = timed(lambda: touch(stagesafe.load_state_dict(uri)))
        second = timed(lambda: touch(stagesafe.load_state_dict(uri)))
        print(json.dumps([first, second]))


def in_fresh_process(how: str, uri: str) -> list[float]:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", how, uri], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--shard", default="250MB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--digests", default="xxh3-128-tree,blake3,sha256")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-bench-load"))
    parser.add_argument("--child", nargs=2, metavar=("HOW", "URI"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return

    import torch

    sys.path.insert(0, os.path.join(_HERE, ".."))
    import stagesafe

    digests = args.digests.split(",")
    n = int(args.gb * 1e9 / 4 / 2**22)
    state = {f"layer{i}.weight": torch.randn(2**11, 2**11) for i in range(n)}
    nbytes = sum(t.nbytes for t in state.values())
    uris = {d: os.path.join(args.root, d) for d in digests}
    for d, uri in uris.items():
        stagesafe.save_state_dict(state, uri, max_shard_size=args.shard, digest=d, overwrite=True)
    shards = len(glob.glob(os.path.join(uris[digests[0]], "*.safetensors")))
    del state

    runs: list[tuple[str, str]] = [("load_file", uris[digests[0]])]
    runs += [(d, uris[d]) for d in digests]
    runs.append(("verify=False", uris[digests[0]]))
    times: dict[str, list[float]] = {}
    for round_ in range(args.repeat):
        for how, uri in runs if round_ % 2 == 0 else reversed(runs):
            seconds = in_fresh_process(how, uri)
            if how == "load_file":
                times.setdefault(_LOAD_FILE, []).append(seconds[0])
            elif how == "verify=False":
                times.setdefault("stagesafe.load_state_dict(verify=False)", []).append(seconds[0])
            else:
                times.setdefault(f"stagesafe, first load in a fresh process ({how} of every byte)", []).append(seconds[0])
                times.setdefault(f"stagesafe, second load in that process ({how} handoff)", []).append(seconds[1])
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians[_LOAD_FILE]
    print(f"\n{nbytes / 1e9:.2f} GB fp32 in {shards} shards; each loader in a fresh process; median of {args.repeat}; "
          f"torch {torch.__version__}; {len(os.sched_getaffinity(0))} CPUs\n")
    print("| loader (every tensor summed after loading) | seconds | GB/s | throughput vs load_file | runs (s) |")
    print("| --- | --- | --- | --- | --- |")
    for name, seconds in medians.items():
        runs_s = ", ".join(f"{s:.3f}" for s in times[name])
        print(f"| {name} | {seconds:.3f} | {nbytes / seconds / 1e9:.2f} | {base / seconds:.2f}x | {runs_s} |")
    print("\nhashing one 256 MiB buffer in memory (this process):")
    from stagesafe.handoff import digest as _digest

    probe = bytearray(os.urandom(1 << 20)) * 256
    for d in digests:
        for workers in (1, _digest.threads()) if d != "sha256" else (1,):  # sha256 is one chain
            start = time.perf_counter()
            _digest.hash_buffer(d, probe, workers=workers)
            rate = len(probe) / (time.perf_counter() - start) / 1e9
            print(f"  {d}, {workers} thread{'s' if workers > 1 else ''}: {rate:.2f} GB/s")
    print(f"\nreproduce: python benchmarks/bench_load.py --gb {args.gb} --shard {args.shard} --repeat {args.repeat} "
          f"--digests {args.digests}")


if __name__ == "__main__":
    main()
