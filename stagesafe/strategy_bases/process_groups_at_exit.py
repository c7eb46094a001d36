"""The process groups DeepSpeed started for the strategy, ended as the interpreter exits.

Lightning ends at exit the NCCL group it starts for DDP (``_destroy_dist_connection``), but not the groups
DeepSpeed starts for its DeepSpeed strategy, gloo or NCCL. A gloo group still alive when the interpreter is torn
down can abort the process after all its work is done (exit -6, "terminate called without an active exception":
gloo's threads release objects whose release needs the interpreter, pytorch/pytorch#190489), so a script that ends
right after ``fit`` failed so at random. DeepSpeed's ``destroy_process_group`` ends torch's groups, then drops
DeepSpeed's copy of the world group (``deepspeed.utils.groups._WORLD_GROUP``), whose gloo threads torch's own
leaves running. A group's threads end when its last reference goes, and after a ``test`` or ``predict`` the last
ones sit in reference cycles of released DeepSpeed objects: a collection frees them here, while the interpreter is
whole (measured: two gloo groups' six threads left after the destroy alone, none after the collection).

It runs among ``atexit``'s hooks, after the handoff's writer has finished (its hook runs before them, see
:mod:`stagesafe.stages.writer`). A group that was up before the strategy asked DeepSpeed for one is its owner's:
it is left alone.
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys

__all__ = ["end_process_groups", "end_process_groups_at_exit"]

log = logging.getLogger(__name__)

_registered = False


def end_process_groups() -> None:
    """End DeepSpeed's groups (torch's with them) or, where DeepSpeed never started one, torch's; then let go of
    what still references them. Nothing happens to groups already ended. Also for a program that ends its own
    job (the benchmarks): the same way the strategy does at exit."""
    deepspeed_comm = sys.modules.get("deepspeed.comm")  # neither imported here: one not imported started no group
    torch_distributed = sys.modules.get("torch.distributed")
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()
    elif torch_distributed is not None and torch_distributed.is_available() and torch_distributed.is_initialized():
        torch_distributed.destroy_process_group()
    gc.collect()  # groups ended by the user too: their last references may sit in cycles all the same


def end_process_groups_at_exit() -> None:
    """Have the process groups ended at exit (once per process, whatever the number of strategies)."""
    global _registered
    if not _registered:
        atexit.register(_end_process_groups_or_warn)
        _registered = True


def _end_process_groups_or_warn() -> None:
    try:
        end_process_groups()
    except Exception as exc:  # noqa: BLE001 - exiting anyway: the group stays, as it would have without this
        log.warning("stagesafe: could not end the process group at exit (%s); the interpreter ends it", exc)
