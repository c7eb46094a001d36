"""The durable handoff write with each shard digest, side by side with the disk's own bandwidth, on the CPU.

Reproduce:  python benchmarks/bench_write_digest.py --gb 2 --rounds 5

Writes the same fp32 tensors as a handoff (1 GB shards, fsynced, committed) on a thread of its own, as the
strategy's background writer does, once per digest (``--digests``), and probes the disk's write+fsync bandwidth
for the same bytes (one writer and four) in the same rounds, the order reversed every other round. Each write
runs twice: with the main thread idle, and beside a "trainer" (the main thread multiplying matrices with
``--trainer-threads`` threads until the write is done), which competes for the CPUs and the GIL as training does.
The question it answers: does the writer's hashing take bandwidth from the disk? The table gives each write's
median GB/s and its share of the best probe; a digest that keeps up with the disk keeps the share of sha256 or
raises it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_boundary import disk_write_seconds  # noqa: E402

import stagesafe  # noqa: E402


def weights(gb: float, tensors: int = 40) -> dict[str, torch.Tensor]:
    per = int(gb * 1e9 / 4 / tensors)
    torch.manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per) for i in range(tensors)}


def background_write(values: dict[str, torch.Tensor], uri: str, digest: str, trainer_threads: int) -> tuple[float, int]:
    """Seconds of the write on its own thread, and the matrix products the main thread did meanwhile."""
    done = threading.Event()
    seconds: list[float] = []
    errors: list[BaseException] = []

    def write() -> None:
        start = time.perf_counter()
        try:
            stagesafe.save_state_dict(values, uri, max_shard_size="1GB", digest=digest, overwrite=True)
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)
        seconds.append(time.perf_counter() - start)
        done.set()

    steps = 0
    thread = threading.Thread(target=write, name="stagesafe-handoff-write", daemon=True)
    if trainer_threads:
        torch.set_num_threads(trainer_threads)
        a = torch.randn(512, 512)
        thread.start()
        while not done.is_set():
            a = torch.tanh(a @ a.T / 512)
            steps += 1
    else:
        thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return seconds[0], steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--digests", default="sha256,xxh3-128-tree,blake3")
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-bench-write-digest"))
    args = parser.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    os.makedirs(args.root)
    values = weights(args.gb)
    nbytes = sum(v.nbytes for v in values.values())

    def write(digest: str, trainer: int):
        def run() -> tuple[float, int]:
            uri = os.path.join(args.root, "handoff")
            result = background_write(values, uri, digest, trainer)
            shutil.rmtree(uri)
            return result

        return run

    def probe(writers: int):
        return lambda: (disk_write_seconds(nbytes, args.root, writers, early_writeback=True), 0)

    probes = {f"disk probe: {n} writer{'s' if n > 1 else ''}, early write-back": probe(n) for n in (1, 4)}
    writes = {}
    for trainer in (0, args.trainer_threads):
        beside = f"beside a trainer ({trainer} thread{'s' if trainer > 1 else ''})" if trainer else "main thread idle"
        for digest in args.digests.split(","):
            writes[f"handoff write, {digest}, {beside}"] = write(digest, trainer)
    everything = {**probes, **writes}
    seconds: dict[str, list[float]] = {name: [] for name in everything}
    steps: dict[str, list[int]] = {name: [] for name in everything}
    for round_ in range(args.rounds):
        for name in list(everything) if round_ % 2 == 0 else list(reversed(everything)):
            s, n = everything[name]()
            seconds[name].append(s)
            steps[name].append(n)
    shutil.rmtree(args.root, ignore_errors=True)
    disk = max(nbytes / statistics.median(seconds[name]) / 1e9 for name in probes)
    print(f"\n{nbytes / 1e9:.2f} GB per write; CPU, {len(os.sched_getaffinity(0))} CPUs; torch {torch.__version__}; "
          f"best disk probe (median) {disk:.2f} GB/s; {args.rounds} rounds, alternating order")
    print("| what writes | GB/s per round | median GB/s, % of the best probe | trainer's matmuls per second (median) |")
    print("| --- | --- | --- | --- |")
    for name, runs in seconds.items():
        rates = [nbytes / s / 1e9 for s in runs]
        median = statistics.median(rates)
        pace = statistics.median(n / s for n, s in zip(steps[name], runs))
        print(f"| {name} | {', '.join(f'{r:.2f}' for r in rates)} | {median:.2f}, {median / disk * 100:.0f}% | "
              f"{f'{pace:.0f}' if pace else '-'} |")
    print(f"\nreproduce: python benchmarks/bench_write_digest.py --gb {args.gb} --rounds {args.rounds} "
          f"--digests {args.digests} --trainer-threads {args.trainer_threads}")


if __name__ == "__main__":
    main()
