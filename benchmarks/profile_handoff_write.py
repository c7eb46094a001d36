"""What the durable handoff write shares its time with, one thing at a time, on the same disk in one run.

Reproduce (2 GPUs, 5.37 GB of fp32 tensors per rank, as a 1.3B-parameter module after a stage):
    torchrun --nproc_per_node 2 benchmarks/profile_handoff_write.py --gb 5.37

Every rank holds a full copy of the weights, as every rank's module does after a stage boundary. Each variant
writes them as a handoff (fp32, sha256 per shard, fsynced, committed), behind a barrier, in alternating rounds:
- who writes: rank 0 alone (``save_state_dict``), or every rank its share (the background write's way);
- the memory it reads: plain, page-locked (``cudaHostRegister``, as the module's tensors are at a stage's
  end), or page-locked and being unlocked by every rank while the write runs (what the call's last hook does);
- where: a fresh folder, or over the handoff of the round before (a stage's handoff replaces the last one),
  its files deleted by the save (before it returns), or after the commit (timed apart).
The disk's own write+fsync bandwidth for the same bytes is probed in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_boundary import disk_write_seconds  # noqa: E402

from stagesafe.storage.fs import resolve  # noqa: E402
from stagesafe.handoff.cleanup import live_files  # noqa: E402
from stagesafe.publishing.commit import Commit, commit_handoff, remove_replaced  # noqa: E402
from stagesafe.handoff.tensor_plan import plan_handoff  # noqa: E402
from stagesafe.handoff.shards import write_shards  # noqa: E402
from stagesafe.stages.channel import JobChannel  # noqa: E402
from stagesafe.stages.host import HostBuffers  # noqa: E402
from stagesafe.stages.shared_write import write_share  # noqa: E402

_SHARD = "1GB"


def weights(gb: float, tensors: int = 40) -> dict[str, torch.Tensor]:
    per = int(gb * 1e9 / 4 / tensors)
    torch.manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per) for i in range(tensors)}


_writes = iter(range(1 << 30))


def write(values: dict[str, torch.Tensor], uri: str, every_rank: bool, remove: bool) -> Commit | None:
    """The handoff, committed, as the strategy's writer commits it; ``remove``: the replaced handoff's files
    deleted too, before returning. The commit on rank 0."""
    done = None
    if every_rank:
        channel = JobChannel.of_job(f"profile-write/{next(_writes)}", timeout=600)
        done = write_share(values, plan_handoff(values, max_shard_size=_SHARD), uri, None, channel=channel,
                           writers=dist.get_world_size(), metadata={})
    elif dist.get_rank() == 0:
        fs, root = resolve(uri)
        plan = plan_handoff(values, max_shard_size=_SHARD, taken=live_files(fs, root))
        done = commit_handoff(fs, root, plan, write_shards(fs, root, plan, list(plan.shards)), metadata={})
    if done is not None and remove:
        remove_replaced(done)
    return done


def timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=5.37, help="fp32 bytes per rank, in GB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-profile-write"))
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else None
    if gpu:
        torch.cuda.set_device(device)
    root = args.root  # the same folder on every rank: they write the shards of one handoff
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    values = weights(args.gb)
    nbytes = sum(v.numel() * v.element_size() for v in values.values())

    def locked() -> HostBuffers:
        return HostBuffers(values, {}, lock_on=device).ready()

    removals: list[float] = []  # deleting the replaced handoff's files after the commit

    def variant(every_rank: bool, memory: str, replacing: str = "") -> Callable[[int], float]:
        """``replacing``: "" writes to a fresh folder; "in the save" or "after the commit" write over the last
        handoff and delete its files then."""

        def run(round_: int) -> float:
            uri = os.path.join(root, "replaced" if replacing else f"fresh-{round_}-{every_rank}-{memory}")
            host = locked() if memory != "plain" and gpu else None
            committed: list[dict | None] = []
            dist.barrier()

            def go() -> None:
                if host is not None and memory == "unlocked meanwhile":
                    host.unlock_in_background(host.existing.values())
                committed.append(write(values, uri, every_rank, remove=replacing != "after the commit"))

            seconds = timed(go)
            if replacing == "after the commit" and committed[0] is not None:
                start = time.perf_counter()
                remove_replaced(committed[0])
                removals.append(time.perf_counter() - start)
            if host is not None:
                host.unlock()
            if rank == 0 and not replacing:
                shutil.rmtree(uri)
            return seconds

        return run

    variants: dict[str, Callable[[int], float]] = {}
    for every_rank in (False, True):
        who = "every rank its share" if every_rank else "rank 0 alone"
        for memory in ("plain", "page-locked", "unlocked meanwhile"):
            if memory != "plain" and not gpu:
                continue
            variants[f"{who}, {memory} memory, fresh folder"] = variant(every_rank, memory)
        variants[f"{who}, plain memory, over the last handoff, its files deleted by the save"] = variant(
            every_rank, "plain", "in the save"
        )
        variants[f"{who}, plain memory, over the last handoff, committed (its files deleted after)"] = variant(
            every_rank, "plain", "after the commit"
        )

    def probe(writers: int) -> Callable[[int], float]:
        def run(round_: int) -> float:
            dist.barrier()
            seconds = disk_write_seconds(nbytes, root, writers, early_writeback=True) if rank == 0 else 0.0
            dist.barrier()
            return seconds

        return run

    probes = {f"disk probe: {n} writer{'s' if n > 1 else ''}, early write-back": probe(n) for n in (1, 4)}
    everything = {**probes, **variants}
    seconds: dict[str, list[float]] = {name: [] for name in everything}
    variant(False, "plain", "in the save")(-1)  # the first "last handoff" for the variants that replace one
    for round_ in range(args.rounds):
        order = list(everything) if round_ % 2 == 0 else list(reversed(everything))
        for name in order:
            seconds[name].append(everything[name](round_))
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        disk = max(nbytes / min(seconds[name]) / 1e9 for name in probes)
        print(f"\n{nbytes / 1e9:.2f} GB per write; {dist.get_world_size()} ranks; {'GPU' if gpu else 'CPU'}; "
              f"best disk probe {disk:.2f} GB/s; {args.rounds} rounds, alternating order")
        print("| what writes | GB/s per round | best, % of the best probe |")
        print("| --- | --- | --- |")
        for name, runs in seconds.items():
            rates = [nbytes / s / 1e9 for s in runs]
            print(f"| {name} | {', '.join(f'{r:.2f}' for r in rates)} | {max(rates):.2f}, "
                  f"{max(rates) / disk * 100:.0f}% |")
        print(f"\ndeleting the replaced handoff's files after the commit: {', '.join(f'{s:.3f}' for s in removals)} s")
        print(f"\nreproduce: torchrun --nproc_per_node {dist.get_world_size()} benchmarks/profile_handoff_write.py "
              f"--gb {args.gb} --rounds {args.rounds}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
