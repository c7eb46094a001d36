"""Imported at start-up by every Python process the tests launch (its folder is on their ``PYTHONPATH``).

- Ranks of one script share one stdout file. Line buffering hands each printed line to the kernel in one write,
  so lines of two ranks never interleave inside a line, and a line is out as soon as it is printed (a test may
  read it while the process runs). ``PYTHONUNBUFFERED`` would write a line's words and its newline separately.
- A process that leaves a gloo process group alive until the interpreter is torn down can abort after all its
  work is done (``terminate called without an active exception``, exit -6: gloo's worker threads still hold
  objects whose release needs the interpreter; pytorch/pytorch#190489). Lightning never destroys the group it
  made, stock or stagesafe, so scripts that end after a Trainer call did so at random under load. At exit the
  groups are destroyed while the interpreter is still whole, as torch's docs ask of every script, through
  DeepSpeed's ``destroy_process_group`` where DeepSpeed started them: torch's alone leaves gloo's threads running
  for the copy of the world group that DeepSpeed keeps (``deepspeed.utils.groups._WORLD_GROUP``), and CI saw a
  rank abort so after its work was done. A collection follows: after a ``test`` or ``predict`` the groups' last
  references sit in reference cycles of released DeepSpeed objects, and their threads end only when those go
  (stagesafe's strategy does the same for the groups it started, ``strategy_bases/process_groups_at_exit.py``).
  This runs after every other exit hook (the first registered runs last): the handoff's writer has finished by then.
"""

import atexit
import gc
import sys

for _stream in (sys.stdout, sys.stderr):
    if _stream is not None and hasattr(_stream, "reconfigure"):
        _stream.reconfigure(line_buffering=True)


def destroy_process_group_at_exit() -> None:
    """Destroy the process groups if this process made any (neither torch nor DeepSpeed is imported for this)."""
    dist = sys.modules.get("torch.distributed")
    deepspeed_comm = sys.modules.get("deepspeed.comm")
    try:
        if deepspeed_comm is not None and deepspeed_comm.is_initialized():
            deepspeed_comm.destroy_process_group()  # torch's groups, then DeepSpeed's references to them
        elif dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - exiting anyway; say why the group stayed
        print(f"sitecustomize: could not destroy the process group at exit: {exc!r}", file=sys.stderr)
    if dist is not None:
        gc.collect()


atexit.register(destroy_process_group_at_exit)
