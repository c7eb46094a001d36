"""Stage-boundary cost of StageSafeDeepSpeedStrategy against its peers and the hardware, in one run.

Reproduce (CPU, 2 processes, about 100M parameters):
    DS_ACCELERATOR=cpu python benchmarks/bench_boundary.py --layers 6 --width 4096
On two GPUs, about 1.3B parameters:
    python benchmarks/bench_boundary.py --accelerator gpu --layers 20 --width 8192

A fit of one step, then a test, on one module (bf16-mixed, ZeRO-3). Measured side by side in the same run:
- stagesafe: entering the stage (first handoff), and leaving it: how long the job is blocked from the end of
  training until ``trainer.fit`` returns (Lightning's teardown included), split into consolidate (fp32 masters
  gathered to host), destroy, restore; and the durable handoff write, which runs in the background after
  the call has returned;
- the Accelerate path: ``engine._zero3_consolidated_16bit_state_dict()`` + ``safetensors.torch.save_file``
  (16-bit weights only), timed on the live engine at the end of training;
- ``safetensors.torch.save_file`` of the fp32 state dict the module ends with, to the same disk;
- the floor: fp32 model bytes divided by the device-to-host bandwidth measured here (on the CPU: memcpy);
- the disk's write bandwidth: write + fsync of the same number of bytes, by one writer and by 4 in
  parallel, each with and without early write-back, the best of the four;
- a timeline of Lightning's teardown steps after the end of each stage.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import stagesafe  # noqa: E402
from stagesafe import StageSafeDeepSpeedStrategy  # noqa: E402


class Wide(pl.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch, batch_idx):
        return self.body(batch[0]).float().pow(2).mean()

    def test_step(self, batch, batch_idx):
        self.body(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class AcceleratePath(Callback):
    """At the end of training, with the engine alive: Accelerate's way of getting the weights out."""

    def __init__(self, path: str, sampler: "ThreadSampler | None" = None, measure: bool = True) -> None:
        self.path = path
        self.measure = measure  # False: only mark the end of the stage (a scale run)
        self.masters: dict[str, torch.Tensor] | None = None
        self.gather = self.save = self.garbage = 0.0
        self.stage_ended = 0.0
        self.sampler = sampler  # started at the end of each stage, stopped once the call has returned

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.measure:
            self._stage_end()
            return
        import deepspeed.utils

        engine = trainer.strategy.model
        # the fp32 masters as the engine holds them, to check the boundary's copies bit for bit
        self.masters = {
            name: deepspeed.utils.safe_get_full_fp32_param(param).detach().cpu().clone()
            for name, param in pl_module.named_parameters()
        }
        dist.barrier()
        start = time.perf_counter()
        state = engine._zero3_consolidated_16bit_state_dict()
        dist.barrier()
        self.gather = time.perf_counter() - start
        if dist.get_rank() == 0:
            start = time.perf_counter()
            save_file({k: v.contiguous() for k, v in state.items()}, self.path)
            self.save = time.perf_counter() - start
            os.remove(self.path)
        del state
        # DeepSpeed gathers through a recursive closure, a reference cycle that keeps the state dict (GBs of
        # host memory on rank 0) alive until the next garbage collection: collected here, on the Accelerate
        # path's account, so that freeing it does not land in the boundary's time
        start = time.perf_counter()
        gc.collect()
        self.garbage = time.perf_counter() - start
        self._stage_end()

    def on_test_end(self, trainer, pl_module) -> None:
        self._stage_end()

    def _stage_end(self) -> None:
        dist.barrier()
        self.stage_ended = time.perf_counter()
        if self.sampler is not None:
            self.sampler.start()


class ThreadSampler:
    """Every millisecond, the innermost Python frame of every thread: what the main thread waits for while a
    stage is torn down. A thread holding the GIL in C code shows as a gap in the samples, and where it is at
    the gap's end."""

    def __init__(self, interval: float = 0.001) -> None:
        self.samples: list[tuple[float, dict[str, str]]] = []
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.samples.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            now, frames = time.perf_counter(), sys._current_frames()
            names = {t.ident: t.name for t in threading.enumerate()}
            where = {
                names.get(ident, str(ident)): f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}"
                f":{f.f_lineno})"
                for ident, f in frames.items()
                if ident != me
            }
            self.samples.append((now, where))
            time.sleep(self._interval)

    def summary(self, start: float, end: float, since: float) -> list[str]:
        """Gaps of more than 4 ms between samples in [start, end], and where each thread was most often."""
        window = [(t, frames) for t, frames in self.samples if start <= t <= end]
        gaps = [(b[0] - a[0], a[0], b[1]) for a, b in zip(window, window[1:]) if b[0] - a[0] > 0.004]
        lines = [f"  {len(window)} samples, {len(gaps)} gaps > 4 ms adding to {sum(g for g, _, _ in gaps):.3f} s"]
        for length, at, frames in sorted(gaps, reverse=True)[:6]:
            where = "; ".join(f"{name}: {frame}" for name, frame in sorted(frames.items()))
            lines.append(f"  gap {length * 1e3:.1f} ms at {at - since:.3f} s, then: {where}")
        counts = Counter((name, frame) for _, frames in window for name, frame in frames.items())
        for (name, frame), n in counts.most_common(10):
            lines.append(f"  {n:5d} x {name}: {frame}")
        return lines


class Timeline:
    """Where the time goes from the end of a stage to the return of the call: Lightning's teardown steps,
    timed by wrapping them on this trainer's own objects."""

    def __init__(self, trainer: pl.Trainer, profile: bool = False) -> None:
        import lightning.pytorch.trainer.call as call

        self.spans: list[tuple[str, float, float, float]] = []  # label, start, end, CPU seconds of its thread
        self.collections: list[tuple[int, float, float]] = []  # garbage collections: generation, start, end
        self._gc_started = (0.0, 0.0)
        gc.callbacks.append(self._gc)  # full garbage collections appear as spans too
        self.profiles: list[str] = []  # with ``profile``: cProfile of the fit loop's teardown, the top entries
        if profile:
            self._profile(trainer.fit_loop, "teardown")
        self._wrap(trainer.strategy, "teardown", "strategy teardown (the boundary, then Lightning's)")
        self._wrap(trainer.strategy.accelerator, "teardown", "accelerator teardown (empty_cache)")
        self._wrap(trainer, "_teardown", "trainer teardown")
        self._wrap(trainer.fit_loop, "teardown", "fit loop teardown")
        self._wrap(trainer.test_loop, "teardown", "test loop teardown")
        self._wrap(trainer._logger_connector, "teardown", "logger connector teardown (metrics to the CPU)")
        self._wrap(call, "_call_teardown_hook", "teardown hooks")

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = (time.perf_counter(), time.thread_time())
            return
        (start, cpu), generation = self._gc_started, info.get("generation")
        self.collections.append((generation, start, time.perf_counter()))
        if generation == 2:
            self.spans.append(("full garbage collection", start, time.perf_counter(), time.thread_time() - cpu))

    def _profile(self, owner, attr: str) -> None:
        import cProfile
        import io
        import pstats

        inner = getattr(owner, attr)

        def profiled(*args, **kwargs):
            profiler = cProfile.Profile()
            try:
                return profiler.runcall(inner, *args, **kwargs)
            finally:
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(14)
                self.profiles.append(out.getvalue())

        setattr(owner, attr, profiled)

    def _wrap(self, owner, attr: str, label: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spans.append((label, start, time.perf_counter(), time.thread_time() - cpu))

        setattr(owner, attr, timed)


def end_distributed_job() -> None:
    """End the job's process groups, as torch asks a distributed program to, the way the strategy does at exit
    (see :mod:`stagesafe.strategy_bases.process_groups_at_exit`). Every background write is joined by then."""
    from stagesafe.strategy_bases.process_groups_at_exit import end_process_groups

    end_process_groups()


def device_to_host_seconds(nbytes: int, accelerator: str) -> tuple[float, float]:
    """Seconds to copy ``nbytes`` to host memory (pinned, on GPUs), and the bandwidth in GB/s."""
    if accelerator == "gpu":
        src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
        dst = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
    else:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        start = time.perf_counter()
        dst.copy_(src)
    seconds = time.perf_counter() - start
    return seconds, nbytes / seconds / 1e9


def disk_write_seconds(nbytes: int, folder: str, writers: int = 1, early_writeback: bool = False) -> float:
    """Write + fsync ``nbytes`` in 64 MB blocks, split over ``writers`` files written by as many threads: what
    the disk sustains for a durable write. ``early_writeback``: ask for each block's write-back as soon as it
    is written, as the store does (so the store gets no edge the probe lacks)."""
    from concurrent.futures import ThreadPoolExecutor

    from stagesafe.storage.writeback import start_writeback

    block = memoryview(os.urandom(64 * 2**20))
    share = -(-nbytes // writers)

    def write(i: int) -> None:
        path = os.path.join(folder, f"disk-probe-{i}.bin")
        size = min(share, nbytes - i * share)
        with open(path, "wb") as f:
            for offset in range(0, size, len(block)):
                f.write(block[: min(len(block), size - offset)])
                if early_writeback:
                    f.flush()
                    start_writeback(f.fileno(), offset, min(len(block), size - offset))
            f.flush()
            os.fsync(f.fileno())

    start = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(writers)))
    seconds = time.perf_counter() - start
    for i in range(writers):
        os.remove(os.path.join(folder, f"disk-probe-{i}.bin"))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument(
        "--write-alone",
        action="store_true",
        help="wait_for_write=True: the handoff write runs while the call waits, with nothing else running",
    )
    parser.add_argument("--profile-teardown", action="store_true", help="cProfile of the fit loop's teardown")
    parser.add_argument(
        "--sample-threads", action="store_true", help="sample every thread's Python frame while leaving each stage"
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="for models of many GB: no Accelerate path, no fp32-masters copy, no save_file or lone-writer "
        "baselines, disk probes with early write-back only, the handoff compared without re-hashing it",
    )
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stagesafe-bench-boundary"))
    args = parser.parse_args()
    os.makedirs(args.root, exist_ok=True)

    torch.manual_seed(0)
    model = Wide(args.layers, args.width)
    n_params = sum(p.numel() for p in model.parameters())
    data = DataLoader(TensorDataset(torch.randn(4, args.width)), batch_size=2)
    strategy = StageSafeDeepSpeedStrategy(
        stage=3, handoff_uri=os.path.join(args.root, "handoff"), wait_for_write=args.write_alone
    )
    sampler = ThreadSampler() if args.sample_threads else None
    accelerate = AcceleratePath(os.path.join(args.root, "accelerate.safetensors"), sampler, measure=not args.scale)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision,
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.root, callbacks=[accelerate],
    )
    timeline = Timeline(trainer, profile=args.profile_teardown)
    rows, timelines, sampled = [], [], []
    for stage in ("fit", "test"):
        timeline.spans.clear()
        timeline.collections.clear()
        getattr(trainer, stage)(model, data)
        returned = time.perf_counter()
        report = strategy.last_boundary
        rows.append((stage, report, returned - accelerate.stage_ended))
        since = accelerate.stage_ended
        spans = [(k, a - since, b - since, cpu) for k, a, b, cpu in timeline.spans]
        collected = [(g, b - a) for g, a, b in timeline.collections if since <= a <= returned]
        timelines.append((stage, spans, returned - since, collected))
        if sampler is not None:
            sampler.stop()
            loop = [(a, b) for k, a, b, _ in timeline.spans if k.endswith("loop teardown")]
            for label, (a, b) in [("leaving", (since, returned)), *[("the loop's teardown", w) for w in loop]]:
                sampled.append((f"threads while {label} {stage} ({a - since:.3f}-{b - since:.3f} s):",
                                sampler.summary(a, b, since)))
    strategy.wait_for_handoff()  # the fit's write was joined by the test; this joins nothing more

    module_equals_masters = accelerate.masters is not None and all(
        torch.equal(dict(model.named_parameters())[n].detach().view(torch.int32), m.view(torch.int32))
        for n, m in accelerate.masters.items()
    )
    peak_rss_gb = [None] * dist.get_world_size()  # ru_maxrss: page-locked memory counts, it is resident
    dist.all_gather_object(peak_rss_gb, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    if dist.get_rank() != 0:
        return
    handoff = stagesafe.load_state_dict(strategy.handoff_uri, verify=not args.scale)
    handoff_equals_module = all(torch.equal(handoff[k].view(torch.uint8), v.view(torch.uint8))
                                for k, v in model.state_dict().items())
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    baseline = alone = None
    if not args.scale:
        baseline_path = os.path.join(args.root, "baseline.safetensors")
        start = time.perf_counter()
        save_file(state, baseline_path)
        baseline = time.perf_counter() - start
        os.remove(baseline_path)
        alone_path = os.path.join(args.root, "alone")
        start = time.perf_counter()
        stagesafe.save_state_dict(state, alone_path, max_shard_size=strategy.max_shard_size)
        alone = time.perf_counter() - start
        shutil.rmtree(alone_path)
    d2h, bandwidth = device_to_host_seconds(nbytes, args.accelerator)
    probes = {
        f"{writers} writer{'s' if writers > 1 else ''}{', early write-back' if early else ''}": disk_write_seconds(
            nbytes, args.root, writers, early
        )
        for writers in (1, 4)
        for early in ((True,) if args.scale else (False, True))
    }
    disk = min(probes.values())

    print(f"\nmodel: {n_params / 1e6:.1f}M parameters, {nbytes / 1e9:.2f} GB fp32; {args.devices} x {args.accelerator}, "
          f"{args.precision}; torch {torch.__version__}")
    saved = f"; save_file (page cache, no fsync): {baseline:.3f} s" if baseline is not None else ""
    print(f"floor (fp32 bytes / device-to-host {bandwidth:.1f} GB/s): {d2h:.3f} s; disk write+fsync: {disk:.3f} s "
          f"({nbytes / disk / 1e9:.2f} GB/s){saved}\n")
    print("peak host memory per rank (ru_maxrss, page-locked memory included): "
          + ", ".join(f"rank {r} {gb:.1f} GB" for r, gb in enumerate(peak_rss_gb)))
    print("disk probes (write+fsync of the same bytes; the best is the reference): "
          + ", ".join(f"{k} {nbytes / v / 1e9:.2f} GB/s" for k, v in probes.items()))
    for stage, spans, returned, collected in timelines:
        ordered = sorted(spans, key=lambda span: span[1])
        shown = ", ".join(f"{label} {a:.3f}-{b:.3f} (cpu {cpu:.3f})" for label, a, b, cpu in ordered if b >= 0)
        counts, seconds_by_generation = Counter(g for g, _ in collected), Counter()
        for generation, seconds in collected:
            seconds_by_generation[generation] += seconds
        collections = ", ".join(f"gen {g}: {counts[g]} in {t:.3f} s" for g, t in sorted(seconds_by_generation.items()))
        print(f"timeline of leaving {stage} (s after the end of the stage; cpu: of the thread that ran it): {shown}; "
              f"returned {returned:.3f}; garbage collections: {collections or 'none'}")
    for title, lines in sampled:
        print(title, *lines, sep="\n")
    for text in timeline.profiles:
        print(f"cProfile of the fit loop's teardown:\n{text}")
    masters = module_equals_masters if accelerate.masters is not None else "not checked (--scale)"
    print(f"bitwise: module after fit == the engine's fp32 masters at the end of training: {masters}; "
          f"handoff == module: {handoff_equals_module}\n")
    print("| path | blocks the job (s) | / floor | until the weights are on disk (s) |")
    print("| --- | --- | --- | --- |")
    acc_total = accelerate.gather + accelerate.save
    if accelerate.measure:
        print(f"| Accelerate: 16-bit gather {accelerate.gather:.3f} + save_file {accelerate.save:.3f} (then a garbage "
              f"collection frees its state dict, {accelerate.garbage:.3f}, not counted) | {acc_total:.3f} | "
              f"{acc_total / d2h:.1f}x | {acc_total:.3f} (16-bit only, no fsync) |")
    for stage, report, blocked in rows:
        phases = {k: v for k, v in report.phases.items() if not k.startswith(("handoff_write", "first_handoff_write"))}
        write = report.phases.get("handoff_write")
        detail = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
        if report.copied_while_waiting:
            detail += f"; cloned for the writer while the call waited: {report.copied_while_waiting / 1e9:.2f} GB"
        if not write:
            durable = "(nothing to write)"
        elif args.write_alone:
            durable = f"{blocked:.3f} (fp32, fsync; written before the call returned)"
        else:
            durable = f"{blocked + write:.3f} (fp32, fsync; written in the background)"
        print(f"| stagesafe leaving {stage}: end of stage to return of the call ({detail}) | {blocked:.3f} | "
              f"{blocked / d2h:.1f}x | {durable} |")
        if stage == "fit":
            enter, first = report.enter_seconds, report.phases.get("first_handoff_write", 0.0)
            print(f"| stagesafe entering {stage} (first handoff: checked writable, written in the background in "
                  f"{first:.3f} s) | {enter:.3f} | {enter / d2h:.1f}x | {enter + first:.3f} |")
    write = rows[0][1].phases.get("handoff_write", 0.0)
    if alone is not None:
        print(f"\nthe store's writer alone (rank 0, one process, nothing else running): {alone:.3f} s = "
              f"{nbytes / alone / 1e9:.2f} GB/s, {disk / alone * 100:.0f}% of the disk's write+fsync bandwidth")
    where = "while the call waited" if args.write_alone else "background"
    fit_phases = rows[0][1].phases
    parts = {k.removeprefix("handoff_write_"): v for k, v in fit_phases.items() if k.startswith("handoff_write_")}
    where += "".join(f"; {k} {v:.3f} s" for k, v in parts.items())
    versus = f"; handoff write / save_file: {write / baseline:.2f}x" if baseline is not None else ""
    print(f"handoff write after fit ({where}): {write:.3f} s = {nbytes / max(write, 1e-9) / 1e9:.2f} GB/s, "
          f"{disk / max(write, 1e-9) * 100:.0f}% of the disk's write+fsync bandwidth{versus}")
    print(f"\nreproduce: python benchmarks/bench_boundary.py --layers {args.layers} --width {args.width} "
          f"--accelerator {args.accelerator} --devices {args.devices} --precision {args.precision}"
          + (" --write-alone" if args.write_alone else "") + (" --profile-teardown" if args.profile_teardown else "")
          + (" --sample-threads" if args.sample_threads else "") + (" --scale" if args.scale else ""))


if __name__ == "__main__":
    main()
    end_distributed_job()
