"""The test launcher itself: what two ranks print into one stdout file comes back as whole lines."""

from __future__ import annotations

import sys
import textwrap

from tests._launch import run_script

# A parent and its child (as Lightning's rank 0 and the rank 1 it starts) print into the same stdout file at once.
TWO_PRINTERS = textwrap.dedent("""
    import subprocess, sys
    rank = sys.argv[1] if len(sys.argv) > 1 else "0"
    child = subprocess.Popen([sys.executable, __file__, "1"]) if rank == "0" else None
    for i in range(3000):
        print("LINE", rank, i, "x" * 200, "END")
    if child is not None:
        sys.exit(child.wait())
""")


def test_lines_printed_by_two_ranks_at_once_never_interleave(tmp_path):
    script = tmp_path / "two_printers.py"
    script.write_text(TWO_PRINTERS)
    lines = run_script(str(script), timeout=120).stdout.splitlines()
    assert len(lines) == 6000
    broken = [line for line in lines if line.split()[0] != "LINE" or line.split()[-1] != "END" or len(line.split()) != 5]
    assert broken == [], broken[:3]
    for rank in ("0", "1"):
        assert [int(line.split()[2]) for line in lines if line.split()[1] == rank] == list(range(3000))


def test_a_launched_process_writes_its_stdout_a_line_at_a_time(tmp_path):
    script = tmp_path / "buffering.py"
    script.write_text("import sys; print(sys.stdout.line_buffering, 'PYTHONUNBUFFERED' in __import__('os').environ)")
    assert run_script(str(script)).stdout.split() == ["True", "False"]


def test_a_launched_process_destroys_its_process_group_at_exit_while_the_interpreter_is_whole(tmp_path):
    script = tmp_path / "group.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, sys
        import torch.distributed as dist
        from sitecustomize import destroy_process_group_at_exit
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
        dist.init_process_group("gloo", rank=0, world_size=1)
        dist.all_reduce(__import__("torch").ones(3))
        print("made", dist.is_initialized())
        destroy_process_group_at_exit()
        print("after", dist.is_initialized())
        destroy_process_group_at_exit()  # none left: nothing to do
    """))
    from tests._launch import free_port

    assert run_script(str(script), [str(free_port())], timeout=120).stdout.split() == ["made", "True", "after", "False"]


def test_the_exit_hook_ends_the_threads_of_deepspeeds_copy_of_the_world_group(tmp_path):
    """ZeRO keeps a copy of the world group (``deepspeed.utils.groups._WORLD_GROUP``): torch's
    ``destroy_process_group`` alone left its gloo threads running into the interpreter's teardown, where a rank
    aborted in CI ("terminate called without an active exception") after all its work was done."""
    script = tmp_path / "deepspeed_group.py"
    script.write_text(textwrap.dedent("""
        import os, sys, threading
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        import deepspeed, torch
        from deepspeed.utils import groups
        from sitecustomize import destroy_process_group_at_exit

        def native_threads():
            return len(os.listdir("/proc/self/task")) - threading.active_count()

        before = native_threads()
        deepspeed.init_distributed(dist_backend="gloo")
        torch.distributed.all_reduce(torch.ones(3), group=groups._clone_world_group())
        print("running", native_threads() > before)
        destroy_process_group_at_exit()
        print("left", native_threads() - before, groups._WORLD_GROUP)
    """))
    from tests._launch import free_port

    out = run_script(str(script), [str(free_port())], timeout=180).stdout.split()
    assert out[-5:] == ["running", "True", "left", "0", "None"], out
