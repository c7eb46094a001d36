"""What the engine held, across a boundary: fp32 masters of every layer, and the optimizer state.

Usage: python engine_state.py PHASE OUT CONFIG [CONFIG ...]
A CONFIG is ``z<stage>-<layers>-<between>``, e.g. ``z3-configure_model-meta``: ZeRO stage, where the layers are
built (``init`` or ``configure_model``, under ``zero.Init``) and ``between_stages``. Every case trains with
bf16-mixed, AdamW with weight decay and a step-wise lr schedule, on a model without randomness in its steps.
Lightning starts rank 1 by re-running this command line; rank 0 saves what it saw under OUT/<config>/.
On a GPU (``ENGINE_STATE_GPU=1``): one device, the 1.41B GPT of benchmarks/bench_leave_fit.py, stock's resume
left out, and each handoff digested per tensor (``<name>.digests.json``) and deleted to spare the disk.
``ENGINE_STATE_CASES=a`` or ``b`` runs only those cases of PHASE ``first`` (one device's time is short).

PHASE ``first`` (one process, every config in turn):
  a-new, a-same: fit (lr 1e-2, 4 steps) -> handoff H1; fit (lr 0) -> H2, with a new Trainer / the same one.
  straight: fit for 2 epochs -> its handoff. first-epoch: fit for 1 epoch -> trainer.save_checkpoint(ckpt).
  For the first config only, the two checkpoints that cannot hold the optimizer state, and their warnings:
  ckpt-not-kept (keep_optimizer_state=False), ckpt-changed (a weight changed in place after fit).
PHASE ``resume`` (a new process): a new module and Trainer, fit(ckpt_path=ckpt, max_epochs=2) under stagesafe
  (-> resumed.safetensors) and under stock Lightning (the CPU-enabled base class: -> stock.safetensors, its fp32
  masters gathered from the live engine).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from toy import ToyModule, dataloader  # noqa: E402

import stagesafe  # noqa: E402
from stagesafe import StageSafeDeepSpeedStrategy  # noqa: E402
from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy  # noqa: E402

STEPS_PER_EPOCH = 4  # 32 samples, 2 ranks, batches of 4 (on a GPU: 8 sequences, 1 device, batches of 2)
GPU = os.environ.get("ENGINE_STATE_GPU") == "1"
CASES = os.environ.get("ENGINE_STATE_CASES", "all")  # "a": only (a); "b": only the fits (b) resumes from


class GPTModule(pl.LightningModule):
    """benchmarks/bench_leave_fit.py's GPT (1.41B), built in __init__ or in configure_model, trained with AdamW."""

    def __init__(self, lr: float, in_configure_model: bool) -> None:
        super().__init__()
        self.lr = lr
        self.gpt = None if in_configure_model else _gpt()

    def configure_model(self) -> None:
        if self.gpt is None:
            self.gpt = _gpt()

    def training_step(self, batch, batch_idx):
        return self.gpt.training_step(batch, batch_idx)

    configure_optimizers = None  # set below, shared with AdamWModule


def _gpt() -> torch.nn.Module:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    from bench_leave_fit import GPT

    return GPT(24, 2048, 50304)


def gpt_data() -> torch.utils.data.DataLoader:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    from bench_leave_fit import data

    return data(50304, n=8, length=129)


def adamw_with_schedule(self):
    """AdamW (weight decay) and an lr that halves every 3 steps."""
    optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class AdamWModule(ToyModule):
    """The toy model trained with AdamW (weight decay) and an lr that halves every 3 steps."""

    configure_optimizers = adamw_with_schedule


GPTModule.configure_optimizers = adamw_with_schedule


def data():
    return gpt_data() if GPU else dataloader()


def parse(config: str) -> dict:
    stage, layers, between = config.split("-")
    return {"stage": int(stage.removeprefix("z")), "layers": layers, "between": between}


def new_module(cfg: dict, lr: float) -> pl.LightningModule:
    pl.seed_everything(7, verbose=False)
    return (GPTModule if GPU else AdamWModule)(lr=lr, in_configure_model=cfg["layers"] == "configure_model")


def stagesafe_strategy(cfg: dict, handoff: str, **kwargs) -> StageSafeDeepSpeedStrategy:
    return StageSafeDeepSpeedStrategy(
        stage=cfg["stage"], handoff_uri=handoff, between_stages=cfg["between"], **kwargs
    )


def trainer(strategy, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="gpu" if GPU else "cpu", devices=1 if GPU else 2, precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )


def keep(trainer_: pl.Trainer, module: torch.nn.Module, uri: str, out: str, name: str) -> None:
    """Rank 0 saves the committed handoff at ``uri`` as ``name``.safetensors, with the module's dtypes."""
    trainer_.strategy.wait_for_handoff()
    if dist.get_rank() == 0:
        values = stagesafe.load_state_dict(uri)
        if GPU:
            with open(f"{out}/{name}.digests.json", "w") as f:
                json.dump(digests(values), f)
            shutil.rmtree(uri)
        else:
            save_file({k: v.contiguous() for k, v in values.items()}, f"{out}/{name}.safetensors")
        dtypes = {n: str(p.dtype) for n, p in module.named_parameters()}
        with open(f"{out}/{name}.module-dtypes.json", "w") as f:
            json.dump(dtypes, f)
    dist.barrier()


def digests(values: dict) -> dict:
    """name -> [dtype, shape, sha256 of the bytes]: equal digests mean bitwise equal tensors."""
    return {n: [str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()]
            for n, t in values.items()}


def release() -> None:
    """Free the last case's modules, and with them their kept engine state, before the next case (on a GPU
    host each keeps gigabytes: the cached page-locked blocks are handed back too)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()


def lr_zero(module: AdamWModule) -> None:
    module.lr = 0.0


def first(cfg: dict, out: str) -> None:
    for mode in ("new", "same") if CASES in ("all", "a") else ():
        module = new_module(cfg, lr=1e-2)
        t1 = trainer(stagesafe_strategy(cfg, f"{out}/a-{mode}-h1"), max_steps=STEPS_PER_EPOCH)
        t1.fit(module, data())
        keep(t1, module, f"{out}/a-{mode}-h1", out, f"a-{mode}-h1")
        lr_zero(module)
        if mode == "new":
            t2 = trainer(stagesafe_strategy(cfg, f"{out}/a-{mode}-h2"), max_steps=STEPS_PER_EPOCH)
            uri2 = f"{out}/a-{mode}-h2"
        else:
            t2, uri2 = t1, f"{out}/a-{mode}-h1"
            t2.fit_loop.epoch_loop.max_steps = 2 * STEPS_PER_EPOCH
        t2.fit(module, data())
        keep(t2, module, uri2, out, f"a-{mode}-h2")
        del module, t1, t2
        release()

    if CASES == "a":
        return
    module = new_module(cfg, lr=1e-2)
    straight = trainer(stagesafe_strategy(cfg, f"{out}/straight"), max_epochs=2)
    straight.fit(module, data())
    keep(straight, module, f"{out}/straight", out, "straight")
    del module, straight
    release()

    module = new_module(cfg, lr=1e-2)
    one = trainer(stagesafe_strategy(cfg, f"{out}/first-epoch"), max_epochs=1)
    one.fit(module, data())
    keep(one, module, f"{out}/first-epoch", out, "first-epoch")
    save_recording_warnings(one, f"{out}/ckpt", f"{out}/save-warnings.json")


def save_recording_warnings(trainer_: pl.Trainer, path: str, record: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_.save_checkpoint(path)
    if dist.get_rank() == 0:
        with open(record, "w") as f:
            json.dump([str(w.message) for w in caught if "optimizer" in str(w.message)], f)


def fallbacks(cfg: dict, out: str) -> None:
    """Checkpoints between calls that cannot hold the optimizer state: said at save_checkpoint."""
    module = new_module(cfg, lr=1e-2)
    t = trainer(stagesafe_strategy(cfg, f"{out}/not-kept", keep_optimizer_state=False), max_steps=2)
    t.fit(module, data())
    save_recording_warnings(t, f"{out}/ckpt-not-kept", f"{out}/not-kept-warnings.json")

    module = new_module(cfg, lr=1e-2)
    t = trainer(stagesafe_strategy(cfg, f"{out}/changed"), max_steps=2)
    t.fit(module, data())
    with torch.no_grad():
        module.backbone.head.bias.add_(1.0)  # the user changes a weight: the kept optimizer state is not its
    save_recording_warnings(t, f"{out}/ckpt-changed", f"{out}/changed-warnings.json")


def resume(cfg: dict, out: str) -> None:
    module = new_module(cfg, lr=1e-2)
    t = trainer(stagesafe_strategy(cfg, f"{out}/resumed"), max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(module, data(), ckpt_path=f"{out}/ckpt")
    keep(t, module, f"{out}/resumed", out, "resumed")
    if dist.get_rank() == 0:
        with open(f"{out}/resume-warnings.json", "w") as f:
            json.dump([str(w.message) for w in caught], f)

    if GPU:
        return
    module = new_module(cfg, lr=1e-2)
    stock = trainer(CPUCapableDeepSpeedStrategy(stage=cfg["stage"]), max_epochs=2)
    stock.fit(module, data(), ckpt_path=f"{out}/ckpt")
    import deepspeed.utils

    masters = {}
    for name, param in module.named_parameters():  # the stock engine is still alive: its fp32 masters
        masters[name] = deepspeed.utils.safe_get_full_fp32_param(param).detach().to("cpu").contiguous()
    if dist.get_rank() == 0:
        save_file(masters, f"{out}/stock.safetensors")
    dist.barrier()


def main() -> None:
    phase, out, *configs = sys.argv[1:]
    for index, config in enumerate(configs):
        folder = os.path.join(out, config)
        os.makedirs(folder, exist_ok=True)
        (first if phase == "first" else resume)(parse(config), folder)
        if phase == "first" and index == 0 and not GPU:
            fallbacks(parse(config), folder)
    if dist.get_rank() == 0:
        print("DONE", phase, json.dumps(configs))


if __name__ == "__main__":
    main()
