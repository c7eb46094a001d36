"""Run sequences of Trainer calls on one module and record what each rank sees after every stage.

Usage: python trainer_sequences.py SPEC.json OUT_PREFIX
Lightning starts rank 1 by re-running this command line, so both ranks run every case in the same order;
each rank writes OUT_PREFIX.rank<r>.json. A case is a dict:
  name, strategy ("stagesafe" | "stock"), stages (e.g. ["fit", "test@best", "validate"]),
  trainer ("one" | "per_call"), precision, lr, max_epochs (int or list per stage), new_root_at (stage
  indices that wrap the previous backbone in a new LightningModule), user_config (a DeepSpeed config dict
  shared by every strategy of the case), checkpoint (ModelCheckpoint on), frozen_hidden.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from toy import ToyModule, dataloader, probe, state_digest  # noqa: E402

from stagesafe import StageSafeDeepSpeedStrategy  # noqa: E402
from stagesafe._cpu import CPUCapableDeepSpeedStrategy  # noqa: E402


class MasterProbe(Callback):
    """At train start (engine built, no step yet): how far the fp32 masters are from the module's input."""

    def __init__(self, reference: dict[str, torch.Tensor]) -> None:
        self.reference = reference
        self.max_abs_diff: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        import deepspeed.utils

        worst = 0.0
        for name, param in pl_module.named_parameters():
            master = deepspeed.utils.safe_get_full_fp32_param(param)
            if master is None:
                continue
            ref = self.reference[name].to(master.device, torch.float32).reshape(master.shape)
            worst = max(worst, (master.float() - ref).abs().max().item())
        self.max_abs_diff = worst


def make_strategy(case: dict, root: str) -> pl.strategies.Strategy:
    kwargs = {"stage": case.get("zero_stage", 3)}
    if case.get("user_config") is not None:
        kwargs = {"config": case["user_config"]}
    if case["strategy"] == "stagesafe":
        return StageSafeDeepSpeedStrategy(handoff_uri=f"{root}/{case['name']}/handoff", **kwargs)
    return CPUCapableDeepSpeedStrategy(**kwargs)


def make_trainer(case: dict, spec: dict, strategy, max_epochs: int, callbacks: list) -> pl.Trainer:
    if case.get("checkpoint"):
        callbacks = callbacks + [ModelCheckpoint(dirpath=f"{spec['root']}/{case['name']}/ckpt", monitor="val_loss", save_last=True)]
    return pl.Trainer(
        accelerator=spec["accelerator"],
        devices=spec["devices"],
        strategy=strategy,
        precision=case.get("precision", "32-true"),
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=bool(case.get("checkpoint")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=f"{spec['root']}/{case['name']}",
        callbacks=callbacks,
    )


def run_stage(trainer: pl.Trainer, module: ToyModule, stage: str) -> None:
    fn, _, ckpt = stage.partition("@")
    kwargs = {"ckpt_path": ckpt} if ckpt else {}
    if fn == "fit":
        if trainer.current_epoch >= trainer.max_epochs:  # a reused Trainer needs a higher epoch budget
            trainer.fit_loop.max_epochs = trainer.current_epoch + 1
        trainer.fit(module, train_dataloaders=dataloader(), val_dataloaders=dataloader(), **kwargs)
    elif fn == "validate":
        trainer.validate(module, dataloaders=dataloader(), verbose=False, **kwargs)
    elif fn == "test":
        trainer.test(module, dataloaders=dataloader(), verbose=False, **kwargs)
    elif fn == "predict":
        trainer.predict(module, dataloaders=dataloader(), **kwargs)
    elif fn == "save":
        trainer.save_checkpoint(ckpt)
    else:
        raise ValueError(f"unknown stage {stage!r}")


def run_case(case: dict, spec: dict) -> dict:
    torch.manual_seed(0)
    module = ToyModule(lr=case.get("lr", 0.1), frozen_hidden=case.get("frozen_hidden", False))
    initial = {n: t.detach().clone() for n, t in module.state_dict().items()}
    result: dict = {"initial_digest": state_digest(module), "stages": []}
    strategy = trainer = None
    max_epochs = case.get("max_epochs", 1)
    for index, stage in enumerate(case["stages"]):
        if index in case.get("new_root_at", []):
            module = ToyModule(backbone=module.backbone, lr=case.get("lr", 0.1))
        epochs = max_epochs[index] if isinstance(max_epochs, list) else max_epochs
        master_probe = MasterProbe(initial)
        record: dict = {"stage": stage, "error": None}
        try:
            if trainer is None or case.get("trainer", "one") == "per_call":
                strategy = make_strategy(case, spec["root"])
                trainer = make_trainer(case, spec, strategy, epochs, [master_probe])
            else:
                trainer.callbacks.append(master_probe)
            run_stage(trainer, module, stage)
        except BaseException as exc:  # noqa: BLE001 - recorded for the test to assert on
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["traceback"] = traceback.format_exc()[-3000:]
        record["master_max_abs_diff"] = master_probe.max_abs_diff
        record["probe"] = probe(module)
        report = getattr(strategy, "last_boundary", None)
        if report is not None:
            record["boundary"] = {"seconds": report.seconds, "wrote": report.wrote, "clean": report.clean, "uri": report.uri}
        if case.get("checkpoint") and trainer is not None and trainer.checkpoint_callback is not None:
            record["best_model_path"] = trainer.checkpoint_callback.best_model_path
        result["stages"].append(record)
        if record["error"] is not None:
            break
    result["user_config_after"] = case.get("user_config")
    return result


def main() -> None:
    spec_path, out_prefix = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    results = {case["name"]: run_case(case, spec) for case in spec["cases"]}
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
