"""Faults at the Trainer level on 2 ranks launched from outside (torchrun-style, ``tests/_launch.run_ranks``).

Usage: python reliability_ranks.py ROOT OUT_PREFIX [CASE,...]   (RANK, WORLD_SIZE, MASTER_* set by the launcher)

Lightning sees LOCAL_RANK and spawns nothing, so each rank is this very process and runs every case below in
the same order. Each rank writes OUT_PREFIX.rank<r>.json: per case, the error each stage raised (type and
message), how long the failing call took, and a probe of the module after every stage.

Cases:
- ``interrupt``: both ranks get SIGINT (KeyboardInterrupt) in ``training_step`` at step 2; Lightning tears down
  and calls ``sys.exit(1)``, which the script catches; then ``test`` and ``fit`` run on the same module.
- ``reference``: a fresh module through ``fit(max_steps=2)``, for the bitwise comparison.
- ``bad_resume:<fault>``: ``resume_from`` names a handoff that is damaged, or that does not fit the module,
  or (``one_rank_missing``) is readable on rank 0 only, as a node-local path would be. Then the same module
  resumes from the intact handoff and runs ``test`` (``one_rank_missing``: runs ``fit`` with no resume).
- ``unwritable``: the handoff folder cannot be created (its parent is a regular file): the first handoff
  write fails on rank 0; then a stage with a writable folder runs.
- ``one_rank_fails`` (only when named in the optional third argument, and alone): ``training_step`` raises on
  rank 1 only; the strategy's ``timeout`` of 5 s bounds rank 0's wait.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl
import torch
from toy import ToyModule, dataloader, probe, quiet_trainer, state_digest, state_digest_of

from stagesafe import StageSafeDeepSpeedStrategy, load_state_dict, save_state_dict
from stagesafe.stages.stage_entry import assert_clean

INTERRUPT_AT = 2
ONE_RANK_TIMEOUT = 5  # seconds: the process group's timeout in the one_rank_fails run


class InterruptedModule(ToyModule):
    """Sends itself SIGINT (Ctrl+C) in ``training_step`` at global step ``interrupt_at``: Python raises
    KeyboardInterrupt there, from the ``sleep`` the signal cuts short."""

    interrupt_at: int | None = None

    def training_step(self, batch, batch_idx):
        if self.interrupt_at is not None and self.global_step == self.interrupt_at:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
            raise AssertionError("SIGINT did not interrupt training_step")
        return super().training_step(batch, batch_idx)


def trainer(root: str, name: str, *, max_steps: int = -1, **strategy_kwargs) -> pl.Trainer:
    return quiet_trainer(root, name, devices=2, max_steps=max_steps, **strategy_kwargs)


def run(record_list: list, label: str, call) -> dict:
    """``call()``; record its error (SystemExit included), duration and a probe of the module after it."""
    record: dict = {"stage": label, "error": None, "error_type": None}
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - recorded for the test to assert on
        record["error_type"] = type(exc).__name__
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()[-3000:]
    record["seconds"] = time.monotonic() - start
    record_list.append(record)
    return record


def describe(module: ToyModule, record: dict) -> None:
    record["probe"] = probe(module)
    try:
        assert_clean(module)
        record["stale"] = None
    except Exception as exc:  # noqa: BLE001
        record["stale"] = str(exc)


def fresh_module(cls=ToyModule, seed: int = 0) -> ToyModule:
    torch.manual_seed(seed)
    return cls()


def case_interrupt(root: str) -> dict:
    module = fresh_module(InterruptedModule)
    module.interrupt_at = INTERRUPT_AT
    stages: list = []
    t = trainer(root, "interrupt")
    rec = run(stages, "fit", lambda: t.fit(module, train_dataloaders=dataloader()))
    describe(module, rec)
    rec["global_step"] = t.global_step
    t.strategy.wait_for_handoff()
    rec["handoff_digest"] = state_digest_of(load_state_dict(f"{root}/interrupt/handoff"))
    module.interrupt_at = None
    rec = run(stages, "test", lambda: t.test(module, dataloaders=dataloader(), verbose=False))
    describe(module, rec)
    t2 = trainer(root, "interrupt")
    rec = run(stages, "fit", lambda: t2.fit(module, train_dataloaders=dataloader()))
    describe(module, rec)
    t2.strategy.wait_for_handoff()
    rec["handoff_digest"] = state_digest_of(load_state_dict(f"{root}/interrupt/handoff"))
    return {"stages": stages}


def case_reference(root: str) -> dict:
    module = fresh_module()
    t = trainer(root, "reference", max_steps=INTERRUPT_AT)
    stages: list = []
    rec = run(stages, "fit", lambda: t.fit(module, train_dataloaders=dataloader()))
    describe(module, rec)
    return {"stages": stages}


def rank_root(root: str) -> str:
    """This rank's own folder for the handoffs it reads (each rank writes its own copy: no collective needed
    before Lightning sets up the process group)."""
    return f"{root}/rank{os.environ['RANK']}"


def good_handoff(root: str) -> str:
    """A handoff of a seed-1 module, in several shards."""
    uri = f"{rank_root(root)}/source/handoff"
    save_state_dict(fresh_module(seed=1).state_dict(), uri, max_shard_size="2KB")
    return uri


FAULTS = ("flipped_byte", "truncated_shard", "missing_shard", "weight_map_disagrees", "reshaped_key", "missing_key")


def bad_handoff(root: str, fault: str) -> tuple[str, str]:
    """A handoff with ``fault``, and the shard an error must name (\"\" for faults that are not a shard's)."""
    from stagesafe.handoff.manifest import manifest_checksum
    from stagesafe.handoff.names import INDEX_NAME, MANIFEST_NAME

    uri = f"{rank_root(root)}/bad/{fault}"
    state = dict(fresh_module(seed=1).state_dict())
    if fault == "reshaped_key":
        state["backbone.head.bias"] = torch.zeros(5)
    if fault == "missing_key":
        del state["backbone.norm.weight"]
    manifest = save_state_dict(state, uri, max_shard_size="2KB")
    shards = list(manifest["shards"])
    victim = os.path.join(uri, shards[1])
    if fault == "flipped_byte":
        with open(victim, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            byte = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x01]))
        return uri, shards[1]
    if fault == "truncated_shard":
        os.truncate(victim, os.path.getsize(victim) - 4)
        return uri, shards[1]
    if fault == "missing_shard":
        os.remove(victim)
        return uri, shards[1]
    if fault == "weight_map_disagrees":  # manifest and index both move a tensor of shard 2 into shard 1
        moved = next(n for n, f in manifest["weight_map"].items() if f == shards[1])
        for name in (MANIFEST_NAME, INDEX_NAME):
            path = os.path.join(uri, name)
            with open(path) as f:
                doc = json.load(f)
            doc["weight_map"][moved] = shards[0]
            if name == MANIFEST_NAME:
                doc["checksum"] = manifest_checksum(doc)  # resealed, as a forger would
            with open(path, "w") as f:
                json.dump(doc, f)
        return uri, shards[0]
    return uri, ""


def case_bad_resume(root: str, name: str, uri: str, good: str | None) -> dict:
    """A fit whose ``resume_from`` is ``uri``, then a test stage resuming from ``good`` (``None``: a plain
    strategy, no resume: the module goes on with whatever the failed call left in it)."""
    module = fresh_module()
    initial = state_digest(module)
    stages: list = []
    folder = name.replace(":", "_")
    t = trainer(root, folder, resume_from=uri)
    rec = run(stages, "fit", lambda: t.fit(module, train_dataloaders=dataloader()))
    describe(module, rec)
    rec["untouched"] = state_digest(module) == initial
    t2 = trainer(root, folder, **({"resume_from": good} if good else {}))
    rec = run(stages, "fit" if good is None else "test", lambda: (t2.test if good else t2.fit)(module, dataloader()))
    describe(module, rec)
    t2.strategy.wait_for_handoff()  # the call returned before its handoff was committed
    rec["handoff_digest"] = state_digest_of(load_state_dict(f"{root}/{folder}/handoff"))
    return {"initial_digest": initial, "stages": stages}


def case_unwritable(root: str) -> dict:
    blocker = f"{root}/unwritable/a_regular_file"
    os.makedirs(os.path.dirname(blocker), exist_ok=True)
    with open(blocker, "w") as f:
        f.write("not a folder\n")
    module = fresh_module()
    initial = state_digest(module)
    stages: list = []
    t = trainer(root, "unwritable", handoff_uri=f"{blocker}/handoff")
    rec = run(stages, "fit", lambda: t.fit(module, train_dataloaders=dataloader()))
    describe(module, rec)
    rec["untouched"] = state_digest(module) == initial
    t2 = trainer(root, "unwritable", handoff_uri=f"{root}/unwritable/handoff")
    rec = run(stages, "fit", lambda: t2.fit(module, train_dataloaders=dataloader()))
    describe(module, rec)
    t2.strategy.wait_for_handoff()
    rec["handoff_digest"] = state_digest_of(load_state_dict(f"{root}/unwritable/handoff"))
    return {"initial_digest": initial, "stages": stages}


class FailsOnRank1(ToyModule):
    def training_step(self, batch, batch_idx):
        if os.environ["RANK"] == "1" and self.global_step == INTERRUPT_AT:
            raise RuntimeError(f"rank 1 fails alone in training_step at step {self.global_step}")
        return super().training_step(batch, batch_idx)


def case_one_rank_fails(root: str) -> dict:
    """Rank 1 raises in ``training_step``; rank 0 does not. The first (and only) Trainer of this process sets
    the process group's timeout, which is what ends rank 0's wait in the training collective."""
    module = fresh_module(FailsOnRank1)
    initial = state_digest(module)
    stages: list = []
    t = trainer(root, "one_rank_fails", timeout=datetime.timedelta(seconds=ONE_RANK_TIMEOUT))
    rec = run(stages, "fit", lambda: t.fit(module, train_dataloaders=dataloader()))
    describe(module, rec)
    t.strategy.wait_for_handoff()  # rank 0 writes alone after the failure, once its collective timed out
    rec["handoff_digest"] = state_digest_of(load_state_dict(f"{root}/one_rank_fails/handoff"))
    return {"initial_digest": initial, "stages": stages}


DEFAULT_CASES = ("interrupt", "reference", "bad_resume", "unwritable")


def main() -> None:
    root, out_prefix = sys.argv[1], sys.argv[2]
    only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else set(DEFAULT_CASES)
    rank = int(os.environ["RANK"])
    results: dict = {}

    def want(name: str) -> bool:
        return name in only

    if want("interrupt"):
        results["interrupt"] = case_interrupt(root)
    if want("reference"):
        results["reference"] = case_reference(root)
    if want("bad_resume"):
        good = good_handoff(root)
        results["source_digest"] = state_digest_of(load_state_dict(good))
        for fault in FAULTS:
            uri, shard = bad_handoff(root, fault)
            results[f"bad_resume:{fault}"] = {"shard": shard, **case_bad_resume(root, f"bad_resume:{fault}", uri, good)}
        # readable on rank 0 only, as a node-local path of rank 0's node would be
        missing = good if rank == 0 else f"{root}/node-local-of-rank-0/handoff"
        results["bad_resume:one_rank_missing"] = case_bad_resume(root, "bad_resume:one_rank_missing", missing, None)
    if want("unwritable"):
        results["unwritable"] = case_unwritable(root)
    if want("one_rank_fails"):  # run alone: its timeout becomes the process group's
        results["one_rank_fails"] = case_one_rank_fails(root)
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
