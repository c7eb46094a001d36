"""Continue training on another number of ranks: save on N, resume on M (tests/test_world_size.py).

Usage: python world_size.py PHASE OUT STAGE RANKS [WRITER]
WRITER ending in ``-frozen`` (``stagesafe-frozen``): the module's hidden layer is frozen, in both phases.
PHASE ``save``: a fit of one epoch on RANKS CPU ranks (bf16-mixed, AdamW with weight decay, an lr halving every
  3 steps), then ``trainer.save_checkpoint(OUT/ckpt)`` under WRITER (``stagesafe``, the default, or ``stock``:
  Lightning's own DeepSpeedStrategy, the CPU-enabled base class). At the end of the fit, while the engine lives,
  rank 0 records the full fp32 masters and Adam moments (DeepSpeed's ``safe_get_full_*``) in
  ``OUT/saved.safetensors`` and the step and lr in ``OUT/saved.json``.
PHASE ``resume``: a new module on RANKS ranks, ``fit(ckpt_path=OUT/ckpt, max_epochs=2)`` under stagesafe; when
  training starts (the checkpoint restored, no step yet) rank 0 records the same in ``OUT/resumed-M.*``, and at the
  end the losses of every step and the handoff's weights in ``OUT/after-M.*``.
PHASE ``refuse``: as ``resume``, but with what cannot be resumed (WRITER names it): ``extra`` (the model has a
  layer the checkpoint lacks), ``sgd`` (another optimizer), ``stage2`` (ZeRO-2 resuming a ZeRO-3 checkpoint),
  ``payload`` (the checkpoint is OUT/crafted, whose pickles carry code; ``payload-stock``: OUT/crafted-stock under
  stock Lightning); rank 0 records the error (or null) in
  ``OUT/refused-<what>-M.json``.
PHASE ``form``: WRITER is the URL of a handoff written by ``stagesafe consolidate --optimizer`` (storage options as
  JSON in ``STAGESAFE_TEST_STORAGE``); a new module on RANKS ranks, ``fit(max_epochs=1)`` under stagesafe with
  ``resume_from=URL``; when training starts rank 0 records masters, moments, step and lr in ``OUT/<name>.*``
  (``STAGESAFE_TEST_RECORD``, default ``form-M``). A URL ending in ``#validate``: ``validate`` first, then the
  fit; ``#validate-here``: the same, writing the handoff where it resumed from (``handoff_uri=URL``). Ending in ``#plain``, ``#extra``, ``#frozen`` or ``#sgd``: that module (see ``refuse``), expected to be
  refused: rank 0 records the error every rank raised (or null) in ``OUT/form-refused-<what>-M.json``.
WRITER ``stagesafe-state``: the strategy hands off the optimizer state beside the weights
  (``handoff_optimizer_state=True``), into ``OUT/saved-handoff``, which the ``form`` phase resumes from.
PHASE ``sequence``: fit -> test -> fit -> (weights changed) test under ``handoff_optimizer_state=True``; after
  each call rank 0 records the optimizer folders of the handoff, the one bound, and ``stagesafe verify``'s exit
  status in ``OUT/sequence.json``.
Lightning starts the other ranks by running this command line again.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from toy import ToyModule, dataloader  # noqa: E402

import stagesafe  # noqa: E402
from stagesafe import StageSafeDeepSpeedStrategy  # noqa: E402
from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy  # noqa: E402


class AdamWModule(ToyModule):
    """The toy model, AdamW with weight decay and an lr that halves every 3 steps; its losses recorded."""

    losses: list
    sgd = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Record(pl.Callback):
    """The engine's full fp32 masters, Adam moments, step and lr, gathered on every rank, kept by rank 0."""

    def __init__(self, hook: str, path: str) -> None:
        self.hook, self.path = hook, path

    def on_train_start(self, trainer, module):
        if self.hook == "start":
            record(trainer, module, self.path)

    def on_train_end(self, trainer, module):
        if self.hook == "end":
            record(trainer, module, self.path)


def record(trainer: pl.Trainer, module: pl.LightningModule, path: str) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    link = getattr(trainer.strategy.deepspeed_engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO 1/2 links each parameter to its optimizer state at its first step, after the
        # first param group stepped (the others' state not made yet): linked again now, to read it
        trainer.strategy.deepspeed_engine.optimizer._hp_optimizer_states_linked = False
        link()
    values = {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        values[f"master/{name}"] = safe_get_full_fp32_param(param).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            state = safe_get_full_optimizer_state(param, key)
            values[f"{key}/{name}"] = state.detach().cpu().clone()
    optimizer = trainer.optimizers[0]
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
    facts = {"global_step": trainer.global_step, "lr": [g["lr"] for g in inner.param_groups], "steps": steps,
             "epoch": trainer.current_epoch}
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in values.items()}, f"{path}.safetensors")
        with open(f"{path}.json", "w") as f:
            json.dump(facts, f)
    dist.barrier()


def trainer(strategy, ranks: int, callback: pl.Callback, max_epochs: int) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=ranks, precision="bf16-mixed", max_epochs=max_epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback],
    )


def new_module(variant: str = "") -> AdamWModule:
    pl.seed_everything(7, verbose=False)
    module = AdamWModule(lr=1e-2, extra_head=variant == "extra", frozen_hidden=variant == "frozen")
    module.losses, module.sgd = [], variant == "sgd"
    return module


def refuse(out: str, stage: int, ranks: int, variant: str) -> None:
    """fit(ckpt_path=...) of what cannot be resumed: rank 0 records the error every rank raised."""
    module = new_module(variant)
    if variant == "payload-stock":  # stock Lightning, on a copy whose payload creates another file
        strategy = CPUCapableDeepSpeedStrategy(stage=stage)
    else:
        strategy = StageSafeDeepSpeedStrategy(stage=2 if variant == "stage2" else stage,
                                              handoff_uri=f"{out}/refused-handoff", overwrite_handoff=True)
    t = trainer(strategy, ranks, pl.Callback(), max_epochs=2)
    ckpt = {"payload": f"{out}/crafted", "payload-stock": f"{out}/crafted-stock"}.get(variant, f"{out}/ckpt")
    try:
        t.fit(module, dataloader(), ckpt_path=ckpt)
        error = None
    except Exception as exc:  # noqa: BLE001 - what the user sees is the point
        error = {"type": type(exc).__name__, "message": str(exc), "steps": len(module.losses)}
    if dist.get_rank() == 0:
        with open(f"{out}/refused-{variant}-{ranks}.json", "w") as f:
            json.dump(error, f)


def resume_from_form(out: str, stage: int, ranks: int, url: str) -> None:
    """fit under ``resume_from=url`` (a handoff with its optimizer state); see the module."""
    url, _, variant = url.partition("#")
    refused = variant not in ("", "validate", "validate-here")
    options = json.loads(os.environ.get("STAGESAFE_TEST_STORAGE") or "null")
    module = new_module("" if variant.startswith("validate") else variant)
    name = os.environ.get("STAGESAFE_TEST_RECORD", f"form-{ranks}")
    if refused:
        name = f"form-refused-{variant}-{ranks}"
    here = url if variant == "validate-here" else f"{out}/{name}-handoff"  # -here: the handoff is written there
    strategy = StageSafeDeepSpeedStrategy(stage=stage, resume_from=url, storage_options=options, handoff_uri=here,
                                          overwrite_handoff=True)
    t = trainer(strategy, ranks, Record("start", f"{out}/{name}"), max_epochs=1)
    if variant.startswith("validate"):  # an inference call first: the weights it took are unchanged, the state theirs
        t.validate(module, dataloader(), verbose=False)
    try:
        t.fit(module, dataloader())
        error = None
    except Exception as exc:  # noqa: BLE001 - what the user sees is the point
        if not refused:
            raise
        error = {"type": type(exc).__name__, "message": str(exc), "steps": len(module.losses)}
    if refused and dist.get_rank() == 0:
        with open(f"{out}/{name}.json", "w") as f:
            json.dump(error, f)


def sequence(out: str, stage: int, ranks: int) -> None:
    """fit -> test -> fit under ``handoff_optimizer_state=True``, then the weights changed by hand and a test:
    after each call rank 0 records the optimizer folders in the handoff, the one its weights name, and what
    ``stagesafe verify`` says, in ``OUT/sequence.json``."""
    from stagesafe.cli import main as cli
    from stagesafe.handoff.optimizer_state import bound_folder

    url, steps = f"{out}/seq-handoff", []
    module = new_module()

    def note(call: str, t: pl.Trainer) -> None:
        t.strategy.wait_for_handoff()
        if dist.get_rank() == 0:
            folders = sorted(d for d in os.listdir(url) if d.startswith("optimizer-"))
            steps.append({"call": call, "folders": folders, "bound": bound_folder(stagesafe.read_manifest(url)),
                          "verify": cli(["verify", "-q", url])})
        dist.barrier()

    def strategy() -> StageSafeDeepSpeedStrategy:
        return StageSafeDeepSpeedStrategy(stage=stage, handoff_uri=url, overwrite_handoff=True,
                                          handoff_optimizer_state=True)

    t = trainer(strategy(), ranks, pl.Callback(), max_epochs=1)
    t.fit(module, dataloader())
    note("fit", t)
    t.test(module, dataloader(), verbose=False)
    note("test", t)
    t = trainer(strategy(), ranks, pl.Callback(), max_epochs=2)
    t.fit(module, dataloader())
    note("fit-again", t)
    with torch.no_grad():
        module.backbone.head.weight.add_(1.0)
    t.test(module, dataloader(), verbose=False)
    note("test-changed", t)
    if dist.get_rank() == 0:
        with open(f"{out}/sequence.json", "w") as f:
            json.dump(steps, f)
        print("DONE sequence", ranks)


def main() -> None:
    phase, out, stage, ranks, *rest = sys.argv[1:]
    stage, ranks, writer = int(stage), int(ranks), (rest[0] if rest else "stagesafe")
    frozen = writer.endswith("-frozen")  # the module's hidden layer is frozen: ZeRO-3 partitions it too
    os.makedirs(out, exist_ok=True)
    if phase == "sequence":
        sequence(out, stage, ranks)
        return
    if phase in ("refuse", "form"):
        (refuse if phase == "refuse" else resume_from_form)(out, stage, ranks, writer)
        if dist.get_rank() == 0:
            print("DONE", phase, ranks)
        return
    module = new_module("frozen" if frozen else "")
    if phase == "save":
        strategy = (CPUCapableDeepSpeedStrategy(stage=stage) if writer.startswith("stock")
                    else StageSafeDeepSpeedStrategy(stage=stage, handoff_uri=f"{out}/saved-handoff",
                                                    handoff_optimizer_state=writer.endswith("-state")))
        t = trainer(strategy, ranks, Record("end", f"{out}/saved"), max_epochs=1)
        t.fit(module, dataloader())
        t.save_checkpoint(f"{out}/ckpt")
    else:
        strategy = StageSafeDeepSpeedStrategy(stage=stage, handoff_uri=f"{out}/after-{ranks}-handoff",
                                              overwrite_handoff=True)
        t = trainer(strategy, ranks, Record("start", f"{out}/resumed-{ranks}"), max_epochs=2)
        t.fit(module, dataloader(), ckpt_path=f"{out}/ckpt")
        t.strategy.wait_for_handoff()
        losses = [None] * ranks
        dist.all_gather_object(losses, module.losses)
        if dist.get_rank() == 0:
            with open(f"{out}/after-{ranks}.json", "w") as f:
                json.dump({"losses": losses, "global_step": t.global_step}, f)
            values = stagesafe.load_state_dict(f"{out}/after-{ranks}-handoff")
            save_file({k: v.contiguous() for k, v in values.items()}, f"{out}/after-{ranks}.safetensors")
    if dist.get_rank() == 0:
        print("DONE", phase, ranks)


if __name__ == "__main__":
    main()
