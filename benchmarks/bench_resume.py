"""Benchmark: putting a ZeRO checkpoint into an engine, stagesafe's re-partitioning load against DeepSpeed's own.

A checkpoint of ``tests/scripts/make_zero_checkpoint.py``'s big model (``--hidden`` x ``--hidden`` x ``--layers``
parameters, AdamW after 2 steps) is saved by ``--saved`` CPU ranks (gloo), then loaded into a new engine by
``tests/scripts/plain_resume.py``: with stagesafe (``read_rank_files`` + ``load_rank_files``) at each world size of
``--resumed``, and with DeepSpeed's ``engine.load_checkpoint`` at the world size that saved (the only one it
loads). Each load is its own job; measured: the load's wall time on rank 0 (both timed from a barrier to a
barrier, stagesafe's modules imported before the clock in both), rank 0's peak RSS for the whole process
(engine included), and the resident memory the load itself added at its peak on rank 0 (the kernel's high-water
mark, reset when the load starts: ``tests/scripts/host_peak.py``). Medians over ``--repeat`` rounds, stock and stagesafe in turns within each round.

    python benchmarks/bench_resume.py --stage 3 --hidden 2048 --layers 8 --saved 2 --resumed 1 2 3
    python benchmarks/bench_resume.py --stage 1 --dtype bf16 --hidden 2048 --layers 8
    python benchmarks/bench_resume.py --stage 3 --hidden 4096 --layers 8 --resumed 1 2 --stepped

``--stepped``: each new engine takes a step before the load (a job that goes back to a checkpoint mid-run), so
it holds its optimizer state when the load begins.

Prints a Markdown table.

``--one-gpu``: the issue's measurement on one GPU machine. A checkpoint of ``--hidden`` x ``--hidden`` x ``--layers``
parameters (bf16-mixed, AdamW, 2 steps) is saved by 2 CPU ranks (gloo) with stock Lightning's DeepSpeed strategy,
then resumed on one GPU with ``trainer.fit(ckpt_path=)`` under stagesafe (``tests/scripts/resume_big.py``): the
strategy's ``load_checkpoint`` (every rank file read by stagesafe's reader, re-partitioned for 1 rank, loaded into
the engine) timed, the process's peak RSS meanwhile read from the kernel (VmHWM, reset when the load starts). Beside it, on the same checkpoint, DeepSpeed's
``ds_to_universal.py`` (the conversion its universal checkpoint needs before any load at another world size):
wall time and the peak of its process tree's PSS (workers included), sampled every 50 ms. Writes
``resume-one-gpu.json``, ``resume-one-gpu.md`` and each step's log under ``--out``; the checkpoint goes under
``--root`` and is deleted at the end (``--keep`` keeps it). ``--accelerator cpu`` runs the same flow on the CPU.

    python benchmarks/bench_resume.py --one-gpu --stage 3 --hidden 8192 --layers 16 --root /tmp --out results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
SCRIPT = os.path.join(REPO, "tests", "scripts", "plain_resume.py")
BIG = os.path.join(REPO, "tests", "scripts", "resume_big.py")


def run(phase: str, out: str, args: argparse.Namespace, ranks: int) -> dict:
    from _launch import run_ranks

    argv = [phase, out, str(args.stage), "--model", "big", "--hidden", str(args.hidden), "--layers",
            str(args.layers), "--dtype", args.dtype, "--no-record", *(["--stepped"] if args.stepped else [])]
    results = run_ranks(SCRIPT, argv, world_size=ranks, timeout=1800, env={"PYTHONPATH": REPO})
    done = [line for line in results[0].stdout.splitlines() if line.startswith("DONE ")]
    return json.loads(done[-1][len("DONE "):])


class TreePss:
    """The peak of a process tree's proportional set size (shared pages split among the processes that map
    them, so forked workers are not counted twice), read from /proc every 50 ms on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        parents: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                parents.setdefault(ppid, []).append(int(entry))
        tree, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo.extend(parents.get(pid, ()))
        return tree

    @staticmethod
    def _pss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, sum(self._pss(pid) for pid in self._tree()))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def one_gpu(args: argparse.Namespace) -> None:
    """See ``--one-gpu`` in the module's docstring."""
    import importlib.util
    import shutil
    import subprocess
    import time

    from _launch import run_script, sanitized_env

    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.root, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-resume-one-gpu-", dir=args.root)
    sizes = ["--stage", str(args.stage), "--hidden", str(args.hidden), "--layers", str(args.layers)]
    results: dict = {"parameters": args.hidden * (args.hidden + 1) * args.layers, "zero_stage": args.stage}

    def log(name: str, text: str) -> None:
        with open(os.path.join(args.out, f"resume-one-gpu-{name}.log"), "w") as f:
            f.write(text)

    def done(result) -> dict:
        log(result_name, result.stdout + result.stderr)
        lines = [line for line in result.stdout.splitlines() if line.startswith("DONE ")]
        return json.loads(lines[-1][len("DONE "):])

    started = time.perf_counter()

    def left() -> float:  # what the budget leaves for the next step
        return max(10.0, args.budget - (time.perf_counter() - started))

    try:
        result_name = "save"
        cpu = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(args.save_threads)}
        results["save"] = done(run_script(BIG, ["save", work, *sizes], timeout=left(), env=cpu))
        print(f"saved by 2 CPU ranks in {time.perf_counter() - started:.0f} s", flush=True)
        ckpt = os.path.join(work, "ckpt")
        results["checkpoint_bytes"] = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(ckpt) for f in files
        )

        result_name = "resume"
        device = {"DS_ACCELERATOR": None if args.accelerator == "gpu" else "cpu", "OMP_NUM_THREADS": "8"}
        argv = ["resume", work, *sizes, "--accelerator", args.accelerator]
        results["stagesafe"] = done(run_script(BIG, argv, timeout=left(), env=device))
        print(f"resumed by stagesafe: {json.dumps(results['stagesafe'])}", flush=True)

        script = importlib.util.find_spec("deepspeed.checkpoint.ds_to_universal").origin
        command = [sys.executable, script, "--input_folder", os.path.join(ckpt, "checkpoint"), "--output_folder",
                   os.path.join(work, "universal"), "--num_extract_workers", str(args.universal_workers),
                   "--num_merge_workers", str(max(1, args.universal_workers // 2))]
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=sanitized_env({"DS_ACCELERATOR": None, "OMP_NUM_THREADS": "8"}))
        tree = TreePss(proc.pid)
        try:
            output, _ = proc.communicate(timeout=left())
        except subprocess.TimeoutExpired:  # the budget is spent: what it reached so far is the result
            proc.kill()
            output = proc.communicate()[0] + f"\n[killed by bench_resume.py: the {args.budget:.0f} s budget is spent]"
        peak = tree.stop()
        log("ds_to_universal", " ".join(command) + "\n" + output)
        results["ds_to_universal"] = {"seconds": time.perf_counter() - start, "exit_code": proc.returncode,
                                      "peak_tree_pss_mib": peak / 2**20, "script": script,
                                      "finished": proc.returncode == 0}
        print(f"ds_to_universal: {json.dumps(results['ds_to_universal'])}", flush=True)
    finally:
        with open(os.path.join(args.out, "resume-one-gpu.json"), "w") as f:
            json.dump(results, f, indent=2)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    ours, theirs = results["stagesafe"], results["ds_to_universal"]
    table = [
        f"ZeRO-{args.stage}, {results['parameters'] / 1e9:.2f}B parameters (bf16-mixed, AdamW), checkpoint of 2 CPU "
        f"ranks ({results['checkpoint_bytes'] / 1e9:.1f} GB), resumed on 1 {args.accelerator.upper()} "
        f"({ours.get('gpu', 'CPU')})\n",
        "| what | seconds | host memory (MiB) |",
        "| --- | --- | --- |",
        f"| stagesafe: fit(ckpt_path=) load, re-partitioned 2 -> 1 and in the engine | {ours['load_seconds']:.1f} | "
        f"peak RSS {ours['rss_peak_during_load_mib']:.0f} (before the load {ours['rss_before_load_mib']:.0f}: "
        f"+{ours['rss_peak_during_load_mib'] - ours['rss_before_load_mib']:.0f}: "
        f"{(ours['rss_peak_during_load_mib'] - ours['rss_before_load_mib']) * 2**20 / results['parameters']:.2f} "
        "bytes per parameter) |",
        f"| DeepSpeed ds_to_universal.py (conversion only; "
        f"{'done' if theirs['finished'] else 'NOT finished, killed at the budget: exit ' + str(theirs['exit_code'])}) "
        f"| {theirs['seconds']:.1f} | "
        f"peak PSS of its processes {theirs['peak_tree_pss_mib']:.0f} |",
    ]
    text = "\n".join(table) + "\n"
    with open(os.path.join(args.out, "resume-one-gpu.md"), "w") as f:
        f.write(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: the engine trains in bf16 (ZeRO-1 under bf16 is DeepSpeed's BF16_Optimizer)")
    parser.add_argument("--saved", type=int, default=2)
    parser.add_argument("--resumed", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", default=None, help="where the checkpoint is written (default: a temporary folder)")
    parser.add_argument("--stepped", action="store_true",
                        help="each new engine takes a step before the load: it holds its optimizer state")
    parser.add_argument("--one-gpu", action="store_true", help="the one-GPU measurement (see above)")
    parser.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu", help="--one-gpu: where it resumes")
    parser.add_argument("--out", default=".", help="--one-gpu: folder for the results and logs")
    parser.add_argument("--save-threads", type=int, default=8, help="--one-gpu: OpenMP threads of each CPU rank")
    parser.add_argument("--universal-workers", type=int, default=8,
                        help="--one-gpu: ds_to_universal's extract workers (merge workers: half)")
    parser.add_argument("--budget", type=float, default=530,
                        help="--one-gpu: seconds for all three steps; ds_to_universal is stopped when they are spent")
    parser.add_argument("--keep", action="store_true", help="--one-gpu: keep the checkpoint and its conversion")
    args = parser.parse_args()
    if args.one_gpu:
        args.root = args.root or tempfile.gettempdir()
        one_gpu(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-resume-", dir=args.root) as out:
        run("save", out, args, args.saved)
        rows: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.repeat):
            rows.setdefault(("deepspeed load_checkpoint", args.saved), []).append(run("stock", out, args, args.saved))
            for ranks in args.resumed:
                rows.setdefault(("stagesafe", ranks), []).append(run("ours", out, args, ranks))
    params = args.hidden * (args.hidden + 1) * args.layers
    print(f"ZeRO-{args.stage}, {params / 1e6:.1f}M parameters ({args.dtype}, AdamW), saved by {args.saved} CPU ranks; "
          f"{'engines that stepped before the load; ' if args.stepped else ''}medians of {args.repeat}\n")
    print("| load | ranks | seconds | rank 0 peak RSS (MiB) | the load's own peak on rank 0: MiB, bytes per parameter |")
    print("| --- | --- | --- | --- | --- |")
    for (who, ranks), runs in rows.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        peak = statistics.median(r["peak_rss_mib"] for r in runs)
        extra = statistics.median(r["load_peak_extra_mib"] for r in runs)
        print(f"| {who} | {ranks} | {seconds:.2f} | {peak:.0f} | +{extra:.0f}, {extra * 2**20 / params:.2f} |")


if __name__ == "__main__":
    main()
