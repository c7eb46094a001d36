"""Large tensors carved out of freed C-heap memory, in a fresh process whose heap nothing else has shaped: where a
long process's large tensors often land, for glibc maps a block of 32 MiB or more on its own only when no free
block of the heap can hold it. Prints one JSON line.

Usage: python heap_carved.py lockable   two 40 MiB tensors: are they in the heap, mid-page, lockable?
       python heap_carved.py copy       the same, then a stage's host memory made ready over the first on the
                                        GPU: is anything locked, and do both and their neighbour still copy?
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from stagesafe.stages import page_lock  # noqa: E402


def heap_range() -> tuple[int, int]:
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            return start, end
    return 0, 0


def carve(*mib: int) -> list[torch.Tensor]:
    raised = torch.empty(20 << 18)  # 20 MiB, mapped: freeing it raises glibc's mmap threshold to 20 MiB
    del raised
    freed = [torch.empty(1 << 18) for _ in range(sum(mib) + 20)]  # 1 MiB each, now from the heap
    above = torch.empty(1 << 18)  # keeps the freed ones from being given back to the system
    del freed
    return [*(torch.ones(n << 18) for n in mib), above]


def carve_mid_page(*mib: int, tries: int = 6) -> list[torch.Tensor]:
    """carve(), again while one of the tensors happens to start on a page boundary (where the heap's layout put
    the freed block: about one process in thirty). Earlier tries are kept, so each lands somewhere new."""
    kept = []
    for _ in range(tries):
        *carved, above = carve(*mib)
        if all(t.data_ptr() % page_lock.PAGE != 0 for t in carved):
            break
        kept.append((carved, above))
    return [*carved, above]


def main() -> None:
    *carved, above = carve_mid_page(40, 40)
    start, end = heap_range()
    result = {
        "in_heap": all(start <= t.data_ptr() < end for t in carved),
        "mid_page": all(t.data_ptr() % page_lock.PAGE != 0 for t in carved),
        "lockable": [page_lock.lockable(t) for t in carved],
        "runs": len(page_lock.page_runs([*carved, above])),
    }
    if sys.argv[1] == "copy":
        from stagesafe.stages.host import HostBuffers

        buffers = HostBuffers({"first": carved[0]}, {}, lock_on=torch.device("cuda", 0)).ready()
        result["locked"] = len(page_lock.locked_ranges())
        result["copies"] = [torch.equal(t.to("cuda").cpu(), t) for t in [*carved, above]]
        buffers.unlock()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
