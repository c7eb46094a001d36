"""The optimizer state a fit gives back at 2 CPU ranks of one host, shared per parameter (stages/shared_state.py).

Usage: python shared_state.py ROOT [bf16]
Lightning starts rank 1 by re-running this command line. AdamW over the 161 parameters of plain_user's Regressor
(the last bias has one element: rank 1 holds none of it), fit for 4 steps; at the fit's end, with the engine live,
every rank gathers each parameter's full moments with DeepSpeed's own ``safe_get_full_optimizer_state`` and saves
DeepSpeed's own checkpoint (``own``). Then, between calls: the given-back optimizer's state beside those moments,
``trainer.save_checkpoint`` (``between``) beside ``own``, a ``step()`` on rank 0 alone, the checkpoint written
after it, and a second fit of 2 steps. With ``bf16``: the layers built in ``configure_model`` (under
``zero.Init``) and ``precision="bf16-mixed"``; after the fit, the module's dtype, the state's beside DeepSpeed's fp32
moments, and a ``step()`` on rank 0, which is refused. Every rank prints "RESULT <rank> <json>".
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from plain_user import Regressor, data  # noqa: E402

import stagesafe  # noqa: E402

REGION = "memfd:stagesafe-shared"


class Gather(pl.Callback):
    """At the fit's end, engine live: the full moments by DeepSpeed, and DeepSpeed's own checkpoint."""

    def __init__(self, own: str) -> None:
        self.own, self.moments = own, {}

    def on_train_end(self, trainer, module):
        from deepspeed.utils import safe_get_full_optimizer_state

        for name, param in module.named_parameters():
            self.moments[name] = {key: safe_get_full_optimizer_state(param, key).clone()
                                  for key in ("exp_avg", "exp_avg_sq")}
        trainer.save_checkpoint(self.own)


def _regions() -> set[str]:
    """The inodes of the shared regions this process maps."""
    with open("/proc/self/maps", encoding="ascii") as f:
        return {line.split()[4] for line in f if REGION in line}


def _flats(folder: str, rank: int) -> list[torch.Tensor]:
    """This rank's per-element optimizer state and fp32 masters in a DeepSpeed checkpoint folder, flat partition
    by partition (read by stagesafe's own pickle reader)."""
    from stagesafe.zero.checkpoint import materialized
    from stagesafe.zero.rank_file import RankFile

    tag = open(os.path.join(folder, "latest")).read().strip()
    name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    if os.path.exists(os.path.join(folder, tag, "bf16_" + name)):
        name = "bf16_" + name
    file = RankFile(os.path.join(folder, tag), name, display=name)
    try:
        state = materialized(file, file.content)["optimizer_state_dict"]
    finally:
        file.close()
    numbered = state["optimizer_state_dict"]["state"]
    return [numbered[n][k] for n in sorted(numbered) for k in ("exp_avg", "exp_avg_sq")] + \
        list(state["fp32_flat_groups"])


class BuiltInConfigureModel(Regressor):
    """Regressor's layers, built where Lightning's docs recommend for large models."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _trainer(root: str, gather: Gather, precision: str) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=stagesafe.StageSafeDeepSpeedStrategy(stage=3), max_steps=4,
        default_root_dir=root, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, callbacks=[gather], precision=precision,
    )


def _given_back(trainer: pl.Trainer, model: pl.LightningModule, gather: Gather) -> tuple[dict, dict]:
    """The given-back optimizer's state by parameter name, and what every rank reports of it."""
    names = {p: n for n, p in model.named_parameters()}
    state = {names[p]: held for p, held in trainer.optimizers[0].state.items()}
    return state, {
        "names": sorted(state),
        "shapes": {n: [list(held[k].shape) for k in ("exp_avg", "exp_avg_sq")] for n, held in state.items()},
        "equal_to_deepspeed": all(torch.equal(state[n][k], gather.moments[n][k])
                                  for n in gather.moments for k in ("exp_avg", "exp_avg_sq")),
        "regions": len(_regions()),
    }


def _step_on_rank_zero(trainer: pl.Trainer, model: pl.LightningModule, state: dict) -> tuple[list[str], str | None]:
    """A ``step()`` of the given-back optimizer on rank 0 alone: the parameters whose state it changed on this rank,
    and the refusal's message, if it was refused."""
    before = {n: {k: held[k].clone() for k in ("exp_avg", "exp_avg_sq")} for n, held in state.items()}
    refused = None
    if trainer.global_rank == 0:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        try:
            trainer.optimizers[0].step()
        except stagesafe.InvalidArgumentError as exc:
            refused = str(exc)
    dist.barrier()
    changed = sorted(n for n, held in state.items() if not all(torch.equal(held[k], before[n][k]) for k in before[n]))
    return changed, refused


def bf16_in_configure_model(root: str) -> None:
    gather = Gather(os.path.join(root, "own"))
    trainer = _trainer(root, gather, "bf16-mixed")
    torch.manual_seed(0)
    model = BuiltInConfigureModel()
    trainer.fit(model, data())
    state, result = _given_back(trainer, model, gather)
    result["module_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    result["state_dtypes"] = sorted({str(held[k].dtype) for held in state.values() for k in ("exp_avg", "exp_avg_sq")})
    result["changed_by_step"], result["step_refused"] = _step_on_rank_zero(trainer, model, state)
    print("RESULT", trainer.global_rank, json.dumps(result), flush=True)


def main(root: str) -> None:
    own, between, after_step = (os.path.join(root, n) for n in ("own", "between", "after_step"))
    gather = Gather(own)
    trainer = _trainer(root, gather, "32-true")
    torch.manual_seed(0)
    model = Regressor()
    trainer.fit(model, data())
    rank, optimizer = trainer.global_rank, trainer.optimizers[0]
    state, result = _given_back(trainer, model, gather)
    first_regions = _regions()

    trainer.save_checkpoint(between)
    dist.barrier()
    mine, theirs = _flats(between, rank), _flats(own, rank)
    result["between_equal_to_own"] = len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs))

    result["changed_by_step"], refused = _step_on_rank_zero(trainer, model, state)
    assert refused is None, refused
    with open(os.devnull, "w") as quiet:
        stderr, sys.stderr = sys.stderr, quiet
        try:
            trainer.save_checkpoint(after_step)
        finally:
            sys.stderr = stderr
    dist.barrier()
    tag = open(os.path.join(after_step, "latest")).read().strip()
    result["after_step_files"] = sorted(os.listdir(os.path.join(after_step, tag)))

    del state  # the views this script holds (as a user may) keep the memory they look into
    trainer.fit_loop.epoch_loop.max_steps = 6  # the same Trainer: another would start rank 1 again
    trainer.fit(model, data())
    result["old_state_after_next_fit"] = len(optimizer.state)
    result["new_state"] = sum(1 for held in trainer.optimizers[0].state.values() if held)
    result["new_optimizer"] = trainer.optimizers[0] is not optimizer
    result["first_region_still_mapped"] = bool(first_regions & _regions())
    result["regions_after_next_fit"] = len(_regions())
    print("RESULT", rank, json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[2:] == ["bf16"]:
        bf16_in_configure_model(sys.argv[1])
    else:
        main(sys.argv[1])
