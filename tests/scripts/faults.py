"""One rank of a 2-rank job (started by run_ranks) that meets a fault; what it sees goes to stdout as JSON.

Usage: python faults.py CASE ROOT [HANDOFF_URI]
  disk_full_at_exit    fit, whose handoff (on a disk too small for it) fails in the background; the script ends.
  disk_full_then_fit   the same, then another fit: its entry raises the failure; a fit after that writes again.
  rank0_killed_mid_write  rank 0 kills itself with SIGKILL as it is about to commit the background write after
                       fit; rank 1 records what wait_for_handoff() raises, then leaves at once.
  rank1_slow_to_read   fit; rank 1's write thread reads rank 0's word on the commit 3 s late; both ranks join
                       (wait_for_handoff()) and the script ends: rank 0 returns at once.
  disk_full_wait_again  fit, whose handoff fails (disk full); wait_for_handoff() three times, then
                       acknowledge_handoff_failure() and once more. Rank 0 logs the boundary lines on stderr.
  vanished             fit, wait; the handoff folder is deleted; test: the stage writes it again.
  vanished_meta        the same with between_stages="meta": test raises HandoffNotFoundError.
  failed_write_metadata  fit (4 steps) whose write fails (disk full), then the disk is freed (rank 0 deletes
                       the file beside the handoff that filled it) and test writes the handoff: its metadata
                       names the fit, step 4.
  one_rank_fails_in_validation  validation_step raises on rank 1; both ranks then call fit.
  one_rank_fails_in_training    training_step raises on rank 1; both ranks then call test.
With FAULT_STRATEGY=stock the same runs under Lightning's strategy, for comparison. Each rank prints ``RECORD {json}`` lines: the stage, its error (type and message), the module's digest and,
on rank 0, the handoff's digest and metadata once joined.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import shutil
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from toy import ToyModule, dataloader, state_digest, state_digest_of  # noqa: E402

import stagesafe  # noqa: E402
from stagesafe.stages.history import history_of  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("FAULT_PG_TIMEOUT", "20")))
RANK = int(os.environ["RANK"])


class FailsOnRank1(ToyModule):
    fail_in: str | None = None

    def validation_step(self, batch, batch_idx):
        if self.fail_in == "validation" and RANK == 1:
            raise RuntimeError("rank 1 fails alone in validation_step")
        return super().validation_step(batch, batch_idx)

    def training_step(self, batch, batch_idx):
        if self.fail_in == "training" and RANK == 1 and self.global_step == 2:
            raise RuntimeError("rank 1 fails alone in training_step")
        return super().training_step(batch, batch_idx)


def record(stage: str, module, call, *, handoff: str | None = None) -> None:
    rec: dict = {"stage": stage, "error": None, "rank": RANK}
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - what the user sees
        rec["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000],
                        "mro": [c.__name__ for c in type(exc).__mro__]}
        rec["traceback"] = traceback.format_exc()[-2500:]
    params = list(module.parameters())
    real = all(p.numel() and p.device.type != "meta" for p in params)
    rec["digest"] = state_digest(module) if real else None
    rec["devices"] = sorted({p.device.type for p in params})
    if handoff is not None and RANK == 0 and os.path.exists(os.path.join(handoff, "stagesafe.json")):
        rec["handoff_digest"] = state_digest_of(stagesafe.load_state_dict(handoff))
        rec["handoff_metadata"] = stagesafe.read_manifest(handoff)["metadata"]
    print("RECORD " + json.dumps(rec, default=str), flush=True)


def trainer(root: str, handoff: str, **kwargs) -> pl.Trainer:
    max_steps = kwargs.pop("max_steps", 4)
    if os.environ.get("FAULT_STRATEGY") == "stock":  # the control: Lightning's strategy, CPU refusal lifted
        from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy

        strategy = CPUCapableDeepSpeedStrategy(stage=3, timeout=TIMEOUT)
    else:
        strategy = stagesafe.StageSafeDeepSpeedStrategy(stage=3, handoff_uri=handoff, timeout=TIMEOUT, **kwargs)
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=max_steps,
        limit_val_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
    )


def main() -> None:
    case, root = sys.argv[1], sys.argv[2]
    handoff = sys.argv[3] if len(sys.argv) > 3 else os.path.join(root, "handoff")
    torch.manual_seed(0)
    module = FailsOnRank1()
    between = "meta" if case == "vanished_meta" else "cpu"
    t = trainer(root, handoff, between_stages=between)
    fit = lambda: t.fit(module, train_dataloaders=dataloader())  # noqa: E731
    test = lambda: t.test(module, dataloaders=dataloader(), verbose=False)  # noqa: E731
    if case == "disk_full_at_exit":
        record("fit", module, fit)
        return  # the write fails as the script ends: the process must not exit 0
    if case == "disk_full_then_fit":
        record("fit", module, fit)
        concurrent.futures.wait([history_of(module).writer.committed], timeout=60)  # failed before the next call
        t.fit_loop.epoch_loop.max_steps = 8  # room for the same Trainer to fit again
        record("fit", module, fit)  # raises the failure at its entry
        t2 = trainer(root, os.path.join(root, "elsewhere"), max_steps=2)
        record("fit", module, lambda: t2.fit(module, train_dataloaders=dataloader()))
        t2.strategy.wait_for_handoff()
        record("joined", module, lambda: None, handoff=os.path.join(root, "elsewhere"))
        return
    if case == "rank0_killed_mid_write":
        if RANK == 0:
            _die_before_the_commit()
        record("fit", module, fit)
        record("joined", module, t.strategy.wait_for_handoff)
        os._exit(0)  # rank 0 is gone: no teardown of the process group
    if case == "rank1_slow_to_read":
        if RANK == 1:
            _read_rank_zeros_word_late(3.0)
        record("fit", module, fit)
        record("joined", module, t.strategy.wait_for_handoff, handoff=handoff)
        return
    if case == "disk_full_wait_again":
        import logging

        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("stagesafe").setLevel(logging.INFO)
        record("fit", module, fit)
        for _ in range(3):
            record("joined", module, t.strategy.wait_for_handoff)
        t.strategy.acknowledge_handoff_failure()
        record("joined", module, t.strategy.wait_for_handoff)
        return
    if case in ("vanished", "vanished_meta"):
        record("fit", module, fit)
        t.strategy.wait_for_handoff()
        record("joined", module, lambda: None, handoff=handoff)
        t.strategy.barrier()
        if RANK == 0:
            shutil.rmtree(handoff)
        t.strategy.barrier()
        record("test", module, test)
        record("joined", module, lambda: t.strategy.wait_for_handoff(), handoff=handoff)
        return
    if case == "failed_write_metadata":
        record("fit", module, fit)
        record("joined", module, lambda: t.strategy.wait_for_handoff())  # raises: the disk is full
        if RANK == 0:
            os.remove(os.path.join(os.path.dirname(handoff), "filler"))
        t.strategy.barrier()
        record("test", module, test)
        record("joined", module, lambda: t.strategy.wait_for_handoff(), handoff=handoff)
        return
    if case == "one_rank_fails_in_validation":
        module.fail_in = "validation"
        record("validate", module, lambda: t.validate(module, dataloaders=dataloader(), verbose=False))
        module.fail_in = None
        record("fit", module, fit)
        return
    if case == "one_rank_fails_in_training":
        module.fail_in = "training"
        record("fit", module, fit)
        module.fail_in = None
        record("test", module, test)
        _leave_at_once()
    raise SystemExit(f"unknown case {case!r}")


def _die_before_the_commit() -> None:
    """This process sends itself SIGKILL as it is about to write the manifest: the killed rank only chooses when."""
    import signal

    from stagesafe.storage import folder
    from stagesafe.handoff.names import MANIFEST_NAME

    real = folder.write_atomic

    def write_atomic(fs, path, data):
        if path.rsplit("/", 1)[-1] == MANIFEST_NAME:
            os.kill(os.getpid(), signal.SIGKILL)
        real(fs, path, data)

    folder.write_atomic = write_atomic


def _read_rank_zeros_word_late(seconds: float) -> None:
    """This rank's write thread reads rank 0's word on the commit ``seconds`` late, as a loaded machine may."""
    import time

    from stagesafe.stages.writer import HandoffWriter

    real = HandoffWriter._rank_zeros_word

    def late(self, write, error):
        time.sleep(seconds)
        return real(self, write, error)

    HandoffWriter._rank_zeros_word = late


def _leave_at_once() -> None:
    """The process group is broken, and gloo may abort as it tears a broken group down at interpreter exit
    ("terminate called without an active exception", seen in CI): every rank says it is done through the job's
    key-value store, whose host (rank 0) waits for the others, then all leave at once. Nothing is being written."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"faults-left-{RANK}", "1")
    if RANK == 0:
        everyone = [f"faults-left-{rank}" for rank in range(dist.get_world_size())]
        store.wait(everyone, datetime.timedelta(seconds=60))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
