"""Two gloo ranks: one rank's failure inside stagesafe's collective helpers must reach the other rank."""

import json
import sys

import torch.distributed as dist

from stagesafe.stages import collectives as _dist
from stagesafe.errors import DistributedStageError

dist.init_process_group("gloo")
rank = dist.get_rank()
seen = {}


def fail_on_rank_1():
    if rank == 1:
        raise OSError("disk full on rank 1")
    return "fine"


def fail_on_rank_0():
    raise PermissionError("read-only folder")


for name, call in (
    ("all_ranks", lambda: _dist.all_ranks(fail_on_rank_1, "writing shards")),
    ("on_rank_zero", lambda: _dist.on_rank_zero(fail_on_rank_0, "publishing the handoff")),
    ("ok", lambda: _dist.all_ranks(lambda: rank, "a no-op")),
):
    try:
        seen[name] = {"result": call()}
    except DistributedStageError as exc:
        seen[name] = {"error": "DistributedStageError", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001
        seen[name] = {"error": type(exc).__name__, "message": str(exc)}
with open(f"{sys.argv[1]}.rank{rank}.json", "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
