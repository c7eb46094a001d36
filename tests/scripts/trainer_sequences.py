"""Run sequences of Trainer calls on one module and record what each rank sees after every stage.

Usage: python trainer_sequences.py SPEC.json OUT_PREFIX
Lightning starts rank 1 by re-running this command line, so both ranks run every case in the same order;
each rank writes OUT_PREFIX.rank<r>.json. A case is a dict:
  name, strategy ("stagesafe" | "stock"), stages (e.g. ["fit", "test@best", "validate"]),
  trainer ("one" | "per_call"), precision, lr, max_epochs (int or list per stage), new_root_at (stage
  indices that wrap the previous backbone in a new LightningModule), user_config (a DeepSpeed config dict
  shared by every strategy of the case), checkpoint (ModelCheckpoint on), frozen_hidden, zero_stage,
  fail_at_step (training_step raises once at that global step), continue_after_error, max_steps,
  file_size_limit_at (stage index, or list of them, during which rank ``limit_rank`` (0) may not write files
  over 2 kB), between_stages ("cpu" | "meta"), meta_module (build the module on the meta device),
  wait_for_write, gated_write (the handoff goes to gatedmem://, whose writes wait until the script opens the
  gate: see run_gated_fit), background_failure (the stage's background write fails: the script does not
  join it, so the next call's entry or end raises it).
A spec may also name "case_groups" built by matrix_cases / scenario_cases below.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import resource
import signal
import sys
import threading
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from toy import ToyModule, dataloader, probe, state_digest, state_digest_of  # noqa: E402

import fsspec  # noqa: E402
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

import stagesafe  # noqa: E402
from stagesafe import StageSafeDeepSpeedStrategy  # noqa: E402
from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy  # noqa: E402
from stagesafe.stages.history import history_of  # noqa: E402


class GatedMemoryFileSystem(MemoryFileSystem):
    """memory:// whose file writes wait while the gate is closed: holds a background write in flight."""

    protocol = "gatedmem"
    gate = threading.Event()

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            self.gate.wait()
        return super()._open(path, mode, **kwargs)


GatedMemoryFileSystem.gate.set()
fsspec.register_implementation("gatedmem", GatedMemoryFileSystem, clobber=True)


class CloseGateWhenTrainingEnds(Callback):
    """The handoff written when this fit ends stays in flight until the script opens the gate again."""

    def on_train_end(self, trainer, pl_module) -> None:
        GatedMemoryFileSystem.gate.clear()


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
            if name not in self.reference:
                continue  # a layer the first module did not have (a new root's own head)
            if self.reference[name].device.type == "meta":
                return  # a module built on the meta device has no input weights to compare with
            ref = self.reference[name].to(master.device, torch.float32).reshape(master.shape)
            worst = max(worst, (master.float() - ref).abs().max().item())
        self.max_abs_diff = worst


STAGES = ("fit", "validate", "test", "predict")


def matrix_cases(strategy: str, precision: str, built_in: tuple = ("init", "configure_model")) -> list[dict]:
    """Every ordered pair of stages, with one Trainer and with a new Trainer per call, for a module whose layers
    are built in ``__init__`` and (``built_in``) for one whose layers are built in ``configure_model`` (under
    ``zero.Init``)."""
    return [
        {"name": f"{strategy}:{a}>{b}:{mode}{':configured' if configured else ''}", "strategy": strategy,
         "stages": [a, b], "trainer": mode, "precision": precision, "in_configure_model": configured}
        for configured in [where == "configure_model" for where in built_in]
        for mode in ("one", "per_call")
        for a in STAGES
        for b in STAGES
    ]


def scenario_cases(strategy: str, precision: str) -> list[dict]:
    """The failures users hit, each as a case; run with "stock" they show the failure, with "stagesafe" the fix."""
    user_config = {"zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    inference_config = {"zero_optimization": {"stage": 3}}  # valid for inference: no optimizer to allow
    offload_config = {  # ZeRO-3 with parameters and optimizer offloaded to the CPU, a client optimizer (SGD)
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    cases = [
        {"name": "demo", "stages": ["validate", "fit", "test", "predict"]},
        {"name": "hooks", "stages": ["fit", "fit", "validate", "fit"]},
        # a new LightningModule (with a head of its own) wrapping the previous one's backbone
        {"name": "new_root_validate_fit", "stages": ["validate", "fit"], "new_root_at": [1], "extra_head": True},
        {"name": "new_root_fit_fit", "stages": ["fit", "fit"], "new_root_at": [1], "extra_head": True},
        {"name": "lr0", "stages": ["fit"], "lr": 0.0},
        # the backbone built in configure_model (zero.Init), a head in __init__: DeepSpeed casts neither to bf16
        {"name": "configured_beside_init", "stages": ["validate", "fit", "test"], "in_configure_model": True,
         "head_in_init": True, "lr": 0.0},
        {"name": "frozen", "stages": ["fit", "test"], "frozen_hidden": True},
        {"name": "continuity_split", "stages": ["fit", "validate", "fit"]},
        {"name": "continuity_whole", "stages": ["fit"], "max_epochs": 2},
        {"name": "ckpt", "stages": ["fit", "test@best", "validate@last", "fit@last"], "checkpoint": True},
        {"name": "config_reuse", "stages": ["fit", "fit"], "trainer": "per_call", "user_config": user_config},
        {"name": "config_inference", "stages": ["validate", "test", "predict"], "user_config": inference_config},
        {"name": "save_between_stages", "stages": ["fit", "save@{root}/final.ckpt", "test@{root}/final.ckpt"]},
        {"name": "save_between_stages_zero2", "stages": ["fit", "save@{root}/final.ckpt", "test@{root}/final.ckpt"],
         "zero_stage": 2},
        {"name": "save_between_stages_then_fit", "stages": ["fit", "save@{root}/final.ckpt", "fit@{root}/final.ckpt"],
         "in_configure_model": True},
        {"name": "offload", "stages": ["fit", "test", "fit"], "user_config": offload_config},
        # meta mode: nothing in host memory between stages; the next engine is fed from the handoff
        {"name": "meta", "stages": ["fit", "test", "fit"], "between_stages": "meta"},
        {"name": "meta_frozen", "stages": ["fit", "test"], "frozen_hidden": True, "between_stages": "meta"},
        {"name": "meta_resumed", "stages": ["test", "fit"], "trainer": "per_call", "between_stages": "meta", "meta_module": True,
         "resume_from": "{root}/" + _slug(f"{strategy}:demo") + "/handoff"},
        {"name": "zero_stage_1", "stages": ["fit", "test", "fit"], "zero_stage": 1},
        {"name": "zero_stage_2", "stages": ["fit", "test", "fit"], "zero_stage": 2},
        {"name": "default_handoff", "stages": ["fit", "test"], "default_handoff": True},
        {"name": "raise_in_fit", "stages": ["fit", "test", "fit"], "fail_at_step": 2, "continue_after_error": True},
        {"name": "two_steps", "stages": ["fit"], "max_steps": 2},
        {"name": "publish_fails", "stages": ["fit", "fit", "test"], "file_size_limit_at": 1, "continue_after_error": True,
         "wait_for_write": True},
        # a later "job" (new strategy, fresh module) continues from the handoff the demo case left behind
        {"name": "resumed", "stages": ["test", "fit"], "trainer": "per_call",
         "resume_from": "{root}/" + _slug(f"{strategy}:demo") + "/handoff"},
    ]
    if strategy == "stagesafe":  # background writes: stock has none
        cases += [
            # a failed background write: the call returns; the next call raises the failure on every rank,
            # and the one after writes the handoff again
            {"name": "background_write_fails", "stages": ["fit", "fit", "test", "test"], "file_size_limit_at": [1, 2],
             "background_failure": 1, "continue_after_error": True},
            # every rank writes a share of the shards: rank 1 cannot, so nothing is committed; as above
            {"name": "share_fails_on_rank_1", "stages": ["fit", "fit", "test", "test"], "file_size_limit_at": [1, 2],
             "limit_rank": 1, "background_failure": 1, "max_shard_size": "2KB", "continue_after_error": True},
            # meta mode's streamed write fails: the weights are gathered into the module instead, the error is
            # raised, and the next stage writes the handoff
            {"name": "meta_write_fails", "stages": ["fit", "fit", "test"], "between_stages": "meta",
             "file_size_limit_at": 1, "continue_after_error": True},
            # a background write held in flight while the module changes in place and both ranks read
            {"name": "gated_write", "stages": ["fit"], "gated_write": True},
        ]
    for case in cases:
        case.update(strategy=strategy, precision=precision, name=f"{strategy}:{case['name']}")
    return cases + [
        # a module left hollow by stock DeepSpeed, then given to stagesafe: refused before any engine is built
        {"name": f"{strategy}:stale_module", "strategy": ["stock", strategy], "stages": ["fit", "validate"],
         "trainer": "per_call", "precision": precision},
    ]


def make_strategy(case: dict, root: str, index: int) -> pl.strategies.Strategy:
    kwargs = {"stage": case.get("zero_stage", 3)}
    if case.get("user_config") is not None:
        kwargs = {"config": case["user_config"]}
    strategy = case["strategy"][index] if isinstance(case["strategy"], list) else case["strategy"]
    if strategy == "stagesafe":
        if case.get("resume_from"):
            kwargs["resume_from"] = case["resume_from"]
        if case.get("between_stages"):
            kwargs["between_stages"] = case["between_stages"]
        if case.get("wait_for_write"):
            kwargs["wait_for_write"] = True
        if case.get("max_shard_size"):
            kwargs["max_shard_size"] = case["max_shard_size"]
        if case.get("default_handoff"):
            return StageSafeDeepSpeedStrategy(**kwargs)
        return StageSafeDeepSpeedStrategy(handoff_uri=handoff_uri_of(case, root), **kwargs)
    if strategy == "lightning":
        return pl.strategies.DeepSpeedStrategy(**kwargs)
    return CPUCapableDeepSpeedStrategy(**kwargs)


def handoff_uri_of(case: dict, root: str) -> str:
    uri = f"{root}/{_slug(case['name'])}/handoff"
    return f"gatedmem://{uri}" if case.get("gated_write") else uri


def run_gated_fit(trainer: pl.Trainer, module: ToyModule, record: dict, uri: str) -> None:
    """fit returns while its handoff write waits at the gate. The module is then changed in place, and rank 0
    reads the handoff while the write is still held: a reader sees only what was committed (nothing yet).
    Rank 0 opens the gate 0.5 s later; once joined, the handoff holds what fit returned, not the change."""
    trainer.callbacks.append(CloseGateWhenTrainingEnds())
    trainer.fit(module, train_dataloaders=dataloader(), val_dataloaders=dataloader())
    record["still_writing"] = not GatedMemoryFileSystem.gate.is_set()
    record["digest_when_fit_returned"] = state_digest(module)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(1.0)
    record["digest_after_change"] = state_digest(module)
    if dist.get_rank() == 0:
        threading.Timer(0.5, GatedMemoryFileSystem.gate.set).start()
        try:
            stagesafe.load_state_dict(uri)
        except stagesafe.HandoffNotFoundError as exc:
            record["read_while_writing"] = type(exc).__name__
    trainer.strategy.wait_for_handoff()
    GatedMemoryFileSystem.gate.set()
    if dist.get_rank() == 0:  # memory:// is private to each process: rank 0 wrote the whole handoff
        record["read_after_join_digest"] = state_digest_of(stagesafe.load_state_dict(uri))


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def make_trainer(case: dict, spec: dict, strategy, max_epochs: int, callbacks: list) -> pl.Trainer:
    if case.get("checkpoint"):
        callbacks = callbacks + [ModelCheckpoint(dirpath=f"{spec['root']}/{_slug(case['name'])}/ckpt", monitor="val_loss", save_last=True)]
    return pl.Trainer(
        accelerator=spec["accelerator"],
        devices=spec["devices"],
        strategy=strategy,
        precision=case.get("precision", "32-true"),
        max_epochs=max_epochs,
        max_steps=case.get("max_steps", -1),
        logger=False,
        enable_checkpointing=bool(case.get("checkpoint")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=f"{spec['root']}/{_slug(case['name'])}",
        callbacks=callbacks,
    )


def run_stage(trainer: pl.Trainer, module: ToyModule, stage: str, root: str) -> None:
    fn, _, ckpt = stage.partition("@")
    ckpt = ckpt.replace("{root}", root)
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
    if case.get("resume_from"):
        case["resume_from"] = case["resume_from"].replace("{root}", spec["root"])
    torch.manual_seed(0)
    with torch.device("meta") if case.get("meta_module") else contextlib.nullcontext():
        module = ToyModule(
            lr=case.get("lr", 0.1), frozen_hidden=case.get("frozen_hidden", False), fail_at_step=case.get("fail_at_step"),
            in_configure_model=case.get("in_configure_model", False), extra_head=case.get("head_in_init", False),
        )
    initial = {n: t.detach().clone() for n, t in module.state_dict().items()}
    built_later = case.get("meta_module") or case.get("in_configure_model")
    result: dict = {"initial_digest": None if built_later else state_digest(module), "stages": []}
    strategy = trainer = None
    max_epochs = case.get("max_epochs", 1)
    for index, stage in enumerate(case["stages"]):
        if index in case.get("new_root_at", []):
            module = ToyModule(backbone=module.backbone, lr=case.get("lr", 0.1), extra_head=case.get("extra_head", False))
        epochs = max_epochs[index] if isinstance(max_epochs, list) else max_epochs
        master_probe = MasterProbe(initial)
        record: dict = {"stage": stage, "error": None}
        limits = case.get("file_size_limit_at", [])
        limited = (
            index in (limits if isinstance(limits, list) else [limits])
            and dist.is_initialized()
            and dist.get_rank() == case.get("limit_rank", 0)
        )
        if limited:  # rank 0 cannot write files larger than 2 kB during this stage: its handoff write fails
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            if trainer is None or case.get("trainer", "one") == "per_call":
                strategy = make_strategy(case, spec["root"], index)
                trainer = make_trainer(case, spec, strategy, epochs, [master_probe])
            else:
                trainer.callbacks.append(master_probe)
            if case.get("gated_write"):
                run_gated_fit(trainer, module, record, handoff_uri_of(case, spec["root"]))
            else:
                run_stage(trainer, module, stage, f"{spec['root']}/{_slug(case['name'])}")
        except BaseException as exc:  # noqa: BLE001 - recorded for the test to assert on
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["traceback"] = traceback.format_exc()[-3000:]
        if index == case.get("background_failure"):  # not joined: the next call raises the failure
            concurrent.futures.wait([history_of(module).writer.committed], timeout=60)  # known at the next entry
        if limited:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        record["master_max_abs_diff"] = master_probe.max_abs_diff
        record["global_step"] = trainer.global_step if trainer is not None else None
        record["probe"] = probe(module)
        report = getattr(strategy, "last_boundary", None)
        if report is not None:
            record["boundary"] = {"seconds": report.seconds, "wrote": report.wrote, "clean": report.clean, "uri": report.uri}
            record["boundary"]["copied_while_waiting"] = report.copied_while_waiting
        failing_write = index == case.get("background_failure")
        if case["strategy"] == "stagesafe" and record["error"] is None and not failing_write:
            strategy.wait_for_handoff()  # every rank: the write may still run in the background
        if case.get("max_shard_size") and case["strategy"] == "stagesafe" and strategy is not None:
            report = strategy.last_boundary  # the writer records its time once its share is written
            record["wrote_a_share"] = report is not None and "handoff_write" in report.phases
        if case["strategy"] == "stagesafe" and os.path.exists(f"{spec['root']}/{_slug(case['name'])}/handoff/stagesafe.json"):
            from stagesafe import load_state_dict, read_manifest

            handoff = load_state_dict(f"{spec['root']}/{_slug(case['name'])}/handoff")
            record["handoff_digest"] = state_digest_of(handoff)
            metadata = read_manifest(f"{spec['root']}/{_slug(case['name'])}/handoff")["metadata"]
            record["handoff_from"] = {k: metadata.get(k) for k in ("stage", "global_step", "call_failed")}
        if case.get("checkpoint") and trainer is not None and trainer.checkpoint_callback is not None:
            record["best_model_path"] = trainer.checkpoint_callback.best_model_path
        result["stages"].append(record)
        if record["error"] is not None and not case.get("continue_after_error"):
            break
        if index == 0 and case.get("fail_at_step") is not None:
            module.fail_at_step = None  # the planned failure happens once
    result["user_config_after"] = case.get("user_config")
    result["handoff_uri"] = f"{spec['root']}/{_slug(case['name'])}/handoff"
    return result


def main() -> None:
    spec_path, out_prefix = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    for group in spec.pop("case_groups", []):  # e.g. {"kind": "matrix", "strategy": "stock", "precision": ...}
        if group["kind"] == "matrix":
            built_in = tuple(group.get("built_in", ("init", "configure_model")))
            cases = matrix_cases(group["strategy"], group["precision"], built_in)
        else:
            cases = scenario_cases(group["strategy"], group["precision"])
        spec["cases"] = spec.get("cases", []) + cases
    results = {case["name"]: run_case(case, spec) for case in spec["cases"]}
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
