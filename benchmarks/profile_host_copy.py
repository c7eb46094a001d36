"""Where the time of leaving a ZeRO-3 stage goes on GPUs: the gather, the copy to the host, the host memory.

Reproduce (2 GPUs, about 1.3B parameters):
    torchrun --nproc_per_node 2 benchmarks/profile_host_copy.py --layers 20 --width 8192

Builds a ZeRO-3 engine (bf16, fp32 masters), trains one step, then times on every rank at once, each step
behind a barrier, the pieces a stage boundary is made of:
- gathering the fp32 masters one parameter at a time (``safe_get_full_fp32_param``, kept on the GPU), and
  the optimizer's flat fp32 partitions in one all-gather per group;
- copying fp32 tensors of the model's size to the host: into fresh pageable memory (what ``.to("cpu")``
  does), into pageable memory that is already resident, into pinned memory (the floor), and through a
  pinned staging buffer into pageable memory;
- the host memory itself: allocating and first touching fresh memory, allocating pinned memory.
Set ``THP_MEM_ALLOC_ENABLE=1`` to have torch back large host allocations with transparent huge pages.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import deepspeed
import deepspeed.utils
import torch
import torch.distributed as dist
from torch import nn


def timed(label: str, fn: Callable[[], object], results: dict[str, float]) -> object:
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    dist.barrier()
    results[label] = time.perf_counter() - start
    return out


def staged_copy(sources: list[torch.Tensor], dests: list[torch.Tensor], stage_bytes: int) -> None:
    """Device to pinned staging (two buffers, alternating), then a host copy into each destination."""
    stages = [torch.empty(stage_bytes // 4, dtype=torch.float32, pin_memory=True) for _ in range(2)]
    events = [torch.cuda.Event(), torch.cuda.Event()]
    stream = torch.cuda.Stream()
    chunks = []
    for src, dst in zip(sources, dests):
        flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
        for start in range(0, flat_src.numel(), stages[0].numel()):
            end = min(start + stages[0].numel(), flat_src.numel())
            chunks.append((flat_src[start:end], flat_dst[start:end]))
    pending: list[tuple[int, torch.Tensor, int]] = []
    for i, (src, dst) in enumerate(chunks):
        slot = i % 2
        if len(pending) == 2:  # the slot is free once its previous chunk has been copied out
            j_slot, j_dst, j_n = pending.pop(0)
            events[j_slot].synchronize()
            j_dst.copy_(stages[j_slot][:j_n])
        with torch.cuda.stream(stream):
            stages[slot][: src.numel()].copy_(src, non_blocking=True)
            events[slot].record(stream)
        pending.append((slot, dst, src.numel()))
    for j_slot, j_dst, j_n in pending:
        events[j_slot].synchronize()
        j_dst.copy_(stages[j_slot][:j_n])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--stage-mb", type=int, default=256)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
    }
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3)
    )
    x = torch.randn(2, args.width, device="cuda", dtype=torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    params = list(engine.module.parameters())
    shapes = [tuple(p.ds_shape) for p in params]
    nbytes = sum(p.ds_numel * 4 for p in params)
    r: dict[str, float] = {}

    full = timed("gather: per parameter (safe_get_full_fp32_param)",
                 lambda: [deepspeed.utils.safe_get_full_fp32_param(p) for p in params], r)
    opt = optimizer  # DeepSpeedZeroOptimizer_Stage3
    world = dist.get_world_size()

    def flat_gather() -> list[torch.Tensor]:
        out = []
        for part in opt.fp32_partitioned_groups_flat:
            buf = torch.empty(part.numel() * world, dtype=part.dtype, device=part.device)
            dist.all_gather_into_tensor(buf, part)
            out.append(buf)
        return out

    timed("gather: flat fp32 partitions, one all-gather per group", flat_gather, r)
    timed("current path: per-parameter gather + .to('cpu')",
          lambda: [deepspeed.utils.safe_get_full_fp32_param(p).to("cpu") for p in params], r)
    timed("D2H into fresh pageable (.to('cpu'))", lambda: [t.to("cpu") for t in full], r)
    resident = [torch.empty(s, dtype=torch.float32) for s in shapes]
    timed("host: allocate + first touch (fill_)", lambda: [t.fill_(1.0) for t in resident], r)
    fresh = [torch.empty(s, dtype=torch.float32) for s in shapes]
    timed("host: allocate + first touch, one thread per tensor pool of 8",
          lambda: _parallel_fill(fresh), r)
    timed("D2H into resident pageable", lambda: [d.copy_(s) for d, s in zip(resident, full)], r)
    pinned = timed("host: allocate pinned",
                   lambda: [torch.empty(s, dtype=torch.float32, pin_memory=True) for s in shapes], r)
    timed("D2H into pinned (floor)", lambda: [d.copy_(s, non_blocking=True) for d, s in zip(pinned, full)], r)
    pinned.clear()  # give the pinned memory back before the next steps
    fresh2 = [torch.empty(s, dtype=torch.float32) for s in shapes]
    timed(f"D2H via {args.stage_mb} MB pinned staging into fresh pageable",
          lambda: staged_copy(full, fresh2, args.stage_mb << 20), r)
    timed(f"D2H via {args.stage_mb} MB pinned staging into resident pageable",
          lambda: staged_copy(full, resident, args.stage_mb << 20), r)
    cudart = torch.cuda.cudart()

    def register() -> None:
        for t in resident:
            assert cudart.cudaHostRegister(t.data_ptr(), t.numel() * 4, 0) == 0

    timed("host: cudaHostRegister resident pageable", register, r)
    timed("D2H into registered (pinned in place)",
          lambda: [d.copy_(s, non_blocking=True) for d, s in zip(resident, full)], r)
    for t in resident:
        cudart.cudaHostUnregister(t.data_ptr())

    if rank == 0:
        thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().strip()
        print(f"\n{sum(p.ds_numel for p in params) / 1e9:.2f}B parameters, {nbytes / 1e9:.2f} GB fp32 per rank, "
              f"{world} ranks, torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"THP_MEM_ALLOC_ENABLE={thp}, THP {mode}\n")
        print("| step (every rank at once) | seconds | GB/s per rank |")
        print("| --- | --- | --- |")
        for label, seconds in r.items():
            print(f"| {label} | {seconds:.3f} | {nbytes / seconds / 1e9:.1f} |")
    dist.barrier()


def _parallel_fill(tensors: list[torch.Tensor]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda t: t.fill_(1.0), tensors))


if __name__ == "__main__":
    main()
