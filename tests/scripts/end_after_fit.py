"""A user's script that ends right after a Trainer call: one rank of a 2-rank job (started by run_ranks).

Usage: python end_after_fit.py SPEC_JSON
SPEC: {"mode": "fit" | "per_rank_folders" | "resume", "root": DIR, "handoff_uri": URL or null,
       "storage_options": {...}, "resume_from": URL, "max_steps": N}
  fit               fit, print the module's digest, end (the handoff write is still running).
  per_rank_folders  each rank its own default_root_dir; fit, then test; print digests.
  resume            a later job: resume_from, test; print the module's digest.
  fit_again         fit, then fit again on the same Trainer (which has reached max_steps): print the warnings and
                    whether the handoff's manifest changed ("REWRITTEN True|False"), then the engine steps of the
                    state a save_checkpoint writes after it ("KEPT_STEPS N": the first fit's).
  marker            keep_optimizer_state=False: fit, save_checkpoint(p) (weights only, marked so); fit again, saving
                    into p from a callback (DeepSpeed's own checkpoint, optimizer included); print "MARKER" and
                    whether it is still there, then the warnings of a new Trainer's fit(ckpt_path=p).
  files             fit, saving DeepSpeed's own folder at its end (during.ckpt), then trainer.save_checkpoint
                    between calls (between.ckpt): rank 0 prints "FILES <name> <json list of relative paths>".
  thread_rule       fit, then Lightning's test-suite thread check (its conftest's logic): every thread the fit
                    left must be a daemon whose stop() leaves it dead; print "STOPPED <names>", then what
                    strategy.deepspeed_engine raises, then the committed handoff's digest ("HANDOFF").
  groups_at_exit    fit, test, end; a hook registered before the Trainer (so run after the strategy's own at exit,
                    before tests/_launched/sitecustomize.py's) prints "AT_EXIT <rank> <torch's group up>
                    <DeepSpeed's copy of the world group held> <gloo threads left>".
  own_group         the same, with the process group started by the script (deepspeed.init_distributed) before
                    the Trainer: the user's, which the strategy leaves alone.
Rank 0 prints "DIGEST <sha256>" (and "TESTED <sha256>" after a test).
"""

from __future__ import annotations

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from toy import ToyModule, dataloader, state_digest, state_digest_of  # noqa: E402

import stagesafe  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    mode = spec["mode"]
    root = spec["root"] if mode != "per_rank_folders" else os.path.join(spec["root"], f"rank{rank}")
    strategy = stagesafe.StageSafeDeepSpeedStrategy(
        stage=3,
        handoff_uri=spec.get("handoff_uri"),
        storage_options=spec.get("storage_options"),
        resume_from=spec.get("resume_from"),
        max_shard_size=spec.get("max_shard_size", "5GB"),
        keep_optimizer_state=mode != "marker",
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=spec.get("max_steps", 3),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, callbacks=[_SaveAtTheEnd(os.path.join(root, "during.ckpt"))] if mode == "files" else None,
    )
    if mode in ("groups_at_exit", "own_group"):
        _report_groups_at_exit(rank, start_group=mode == "own_group")
    torch.manual_seed(0)
    module = ToyModule()
    threads_before = set(threading.enumerate())
    if mode == "resume":
        trainer.test(module, dataloaders=dataloader(), verbose=False)
        if rank == 0:
            print("TESTED", state_digest(module), flush=True)
        return
    trainer.fit(module, train_dataloaders=dataloader())
    if rank == 0:
        print("DIGEST", state_digest(module), flush=True)
    if mode == "fit_again":
        import warnings

        strategy.wait_for_handoff()
        committed = stagesafe.read_manifest(strategy.last_boundary.uri)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, train_dataloaders=dataloader())
        strategy.wait_for_handoff()
        if rank == 0:
            print("AGAIN", state_digest(module), flush=True)
            print("REWRITTEN", stagesafe.read_manifest(strategy.last_boundary.uri) != committed, flush=True)
        saved = os.path.join(root, "after_again.ckpt")
        trainer.save_checkpoint(saved)  # between calls: the engine state kept from the first fit
        if rank == 0:
            states = torch.load(os.path.join(saved, "checkpoint", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                                weights_only=False)
            print("KEPT_STEPS", states["global_steps"], flush=True)
            for warning in caught:
                print("WARNING", str(warning.message).replace("\n", " "), flush=True)
    if mode == "marker":
        _marker_after_deepspeed_saves(trainer, module, root, rank)
    if mode == "files":
        trainer.save_checkpoint(os.path.join(root, "between.ckpt"))  # between calls: the kept files
        if rank == 0:
            for name in ("during", "between"):
                print("FILES", name, json.dumps(_files(os.path.join(root, f"{name}.ckpt"))), flush=True)
    if mode == "thread_rule":
        stopped = _thread_check(threads_before)
        try:
            strategy.deepspeed_engine
        except stagesafe.EngineReleasedError as exc:
            print(f"ENGINE rank{rank} EngineReleasedError: {exc}", flush=True)
        if rank == 0:
            print("STOPPED", ",".join(stopped) or "-", flush=True)
            print("HANDOFF", state_digest_of(stagesafe.load_state_dict(strategy.last_boundary.uri)), flush=True)
        _lightnings_warnings(trainer, module, root, rank)
    if mode in ("per_rank_folders", "groups_at_exit", "own_group"):
        trainer.test(module, dataloaders=dataloader(), verbose=False)
        if rank == 0:
            print("TESTED", state_digest(module), flush=True)
    # the script ends here: the handoff of the last fit may still be being written


def _report_groups_at_exit(rank: int, *, start_group: bool) -> None:
    """Print, at exit, what is left of the process groups once every hook registered after this one has run."""
    import atexit

    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    if start_group:
        deepspeed.init_distributed(dist_backend="gloo")

    def report() -> None:
        gloo = [name for name in _thread_names() if "gloo" in name]
        print("AT_EXIT", rank, dist.is_initialized(), groups._WORLD_GROUP is not None, len(gloo), flush=True)

    atexit.register(report)


def _thread_names() -> list[str]:
    """The names of this process's native threads (gloo's are ``gloo_tcp_loop`` and ``pt_gloo_runloop``)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


class _SaveAtTheEnd(pl.Callback):
    """Saves at the end of training, while the engine is live: DeepSpeed's own folder."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def _files(folder: str) -> list[str]:
    """Every file under ``folder``, relative, with an x where it is executable by its owner."""
    found = []
    for where, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(where, name)
            found.append(os.path.relpath(path, folder) + (" x" if os.stat(path).st_mode & 0o100 else ""))
    return sorted(found)


def _marker_after_deepspeed_saves(trainer: pl.Trainer, module: ToyModule, root: str, rank: int) -> None:
    import warnings

    from stagesafe.zero.checkpoint_writer import WEIGHTS_ONLY_MARKER

    path = os.path.join(root, "shared.ckpt")
    trainer.save_checkpoint(path)  # between calls, optimizer state not kept: weights only, marked

    class SaveAtTheEnd(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            trainer.save_checkpoint(path)  # the engine is live: DeepSpeed's own, with the optimizer state

    again = pl.Trainer(
        accelerator="cpu", devices=2, strategy=stagesafe.StageSafeDeepSpeedStrategy(stage=3), precision="bf16-mixed",
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, callbacks=[SaveAtTheEnd()],
    )
    again.fit(module, train_dataloaders=dataloader())
    if rank == 0:
        print("MARKER", os.path.exists(os.path.join(path, WEIGHTS_ONLY_MARKER)), flush=True)
    resumed = pl.Trainer(
        accelerator="cpu", devices=2, strategy=stagesafe.StageSafeDeepSpeedStrategy(stage=3), precision="bf16-mixed",
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(module, train_dataloaders=dataloader(), ckpt_path=path)
    if rank == 0:
        for warning in caught:
            print("WARNING", str(warning.message).replace("\n", " "), flush=True)


def _lightnings_warnings(trainer: pl.Trainer, module: ToyModule, root: str, rank: int) -> None:
    """Paths stock Lightning warns on: saving a ZeRO-3 folder between calls, and resuming fit from a single
    file with load_full_weights. Rank 0 prints each warning as "WARNING <text>"."""
    import warnings

    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    folder, single = os.path.join(root, "between.ckpt"), os.path.join(root, "single.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_checkpoint(folder)
        if rank == 0:
            convert_zero_checkpoint_to_fp32_state_dict(folder, single)
        trainer.strategy.barrier()
        strategy = stagesafe.StageSafeDeepSpeedStrategy(stage=3, load_full_weights=True)
        again = pl.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=5, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        )
        again.fit(module, train_dataloaders=dataloader(), ckpt_path=single)
    if rank == 0:
        for warning in caught:
            print("WARNING", str(warning.message).replace("\n", " "), flush=True)


def _thread_check(before: set[threading.Thread]) -> list[str]:
    """Lightning's ``thread_police_duuu_daaa_duuu_daaa`` (tests_pytorch/conftest.py, 2.6.5), as written there
    (less its XLA skip), on the threads the fit left: a daemon with a callable ``stop`` is stopped and must be
    dead; threads of a few known kinds are joined or let be; any other fails. Returns the stopped names."""
    from concurrent.futures.process import _ExecutorManagerThread

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from tqdm import TMonitor

    stopped = []
    for thread in set(threading.enumerate()) - before:
        stop = getattr(thread, "stop", None) or getattr(thread, "exit", None)
        if thread.daemon and callable(stop):
            stop()
            assert not thread.is_alive()
            stopped.append(thread.name.split(" ")[0])
        elif isinstance(thread, _ChildProcessObserver):
            thread.join(timeout=10)
        elif thread.name in ("QueueFeederThread", "QueueManagerThread") or "(_read_thread)" in thread.name:
            thread.join(timeout=20)
        elif isinstance(thread, TMonitor):
            thread.exit()
        elif (
            isinstance(thread, _ExecutorManagerThread)
            or "ThreadPoolExecutor-" in thread.name
            or thread.name == "InductorSubproc"
        ):
            continue
        elif thread.name == "fsspecIO":
            continue
        else:
            raise AssertionError(f"Test left zombie thread: {thread}")
    return sorted(stopped)

if __name__ == "__main__":
    main()
