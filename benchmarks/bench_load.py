"""Load throughput of ``stagesafe.load_state_dict`` against ``safetensors.torch.load_file`` on the same files.

Reproduce:  python benchmarks/bench_load.py --gb 1 --shard 250MB --repeat 5
From disk:  python benchmarks/bench_load.py --gb 4 --shard 1GB --repeat 5 --cold     (root: drops the page cache)

Writes one handoff of about ``--gb`` GB of fp32 tensors per digest (``--digests``), then times, each in a fresh
process (imports excluded, the loader's module included; files in the page cache for every loader alike, or,
with ``--cold``, dropped from it before every run):
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
    load_state_dict = stagesafe.load_state_dict  # its module imported before the clock, as load_file's is
    if how == "verify=False":
        print(json.dumps([timed(lambda: touch(load_state_dict(uri, verify=False)))]))
    elif how != "load_file":
        first = timed(lambda: touch(load_state_dict(uri)))
        second = timed(lambda: touch(load_state_dict(uri)))
        print(json.dumps([first, second]))


def drop_page_cache() -> None:
    """Every file's cached pages dropped (Linux, root): the next read comes from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        sys.exit(f"--cold drops the page cache before every run, which needs root on Linux ({exc})")


def memory_bandwidth() -> tuple[float, float]:
    """GB/s of one read pass (a sum) and of a copy (read + write) over 1 GiB, on every core."""
    import torch

    src = torch.ones(2**28)
    dst = torch.empty_like(src)
    dst.copy_(src)  # both touched once
    rates = []
    for fn, passes in ((lambda: src.sum(), 1), (lambda: dst.copy_(src), 2)):
        start = time.perf_counter()
        for _ in range(3):
            fn()
        rates.append(3 * passes * src.nbytes / (time.perf_counter() - start) / 1e9)
    return rates[0], rates[1]


def in_fresh_process(how: str, uri: str, *, cold: bool = False) -> list[float]:
    if cold:
        drop_page_cache()
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
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every run (root)")
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
            seconds = in_fresh_process(how, uri, cold=args.cold)
            if how == "load_file":
                times.setdefault(_LOAD_FILE, []).append(seconds[0])
            elif how == "verify=False":
                times.setdefault("stagesafe.load_state_dict(verify=False)", []).append(seconds[0])
            else:
                times.setdefault(f"stagesafe, first load in a fresh process ({how} of every byte)", []).append(seconds[0])
                times.setdefault(f"stagesafe, second load in that process ({how} handoff)", []).append(seconds[1])
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians[_LOAD_FILE]
    cache = "page cache dropped before every run (a second load reads it cached)" if args.cold else "page cache warm"
    print(f"\n{nbytes / 1e9:.2f} GB fp32 in {shards} shards; each loader in a fresh process; {cache}; median of "
          f"{args.repeat}; torch {torch.__version__}; {len(os.sched_getaffinity(0))} CPUs")
    read_rate, copy_rate = memory_bandwidth()
    print(f"memory bandwidth, this host: {read_rate:.1f} GB/s reading (one pass, every core), {copy_rate:.1f} GB/s "
          "copying (read + write)\n")
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
          f"--digests {args.digests}{' --cold' if args.cold else ''}")


if __name__ == "__main__":
    main()
