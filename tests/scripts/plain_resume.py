"""A checkpoint of plain DeepSpeed (``engine.save_checkpoint``) put into an engine of another world size through
stagesafe's reader; run as N ranks (tests/_launch.py: run_ranks).

Usage: plain_resume.py PHASE OUT STAGE [--model tiny|big --hidden H --layers L --dtype fp32|bf16]
PHASE ``save``: make_zero_checkpoint.py's engine (the tiny model: a tied weight, a frozen layer, two param groups
  of AdamW, sizes no world size divides) takes 2 steps, records its full fp32 masters and Adam moments
  (``OUT/saved.safetensors``, rank 0) and saves ``OUT/ckpt``.
PHASE ``ours``: a new engine loads ``OUT/ckpt`` with stagesafe (read_rank_files, load_rank_files) and records the
  same in ``OUT/ours-<world size>.safetensors``; then takes a step.
PHASE ``stock``: the same with DeepSpeed's own ``engine.load_checkpoint`` (only at the world size that saved).
``--stepped``: the new engine takes a step before the load (a job that goes back to a checkpoint mid-run), so it
  holds its optimizer state when the load begins.
PHASE ``form``: the same from ``OUT/form``, the handoff ``stagesafe consolidate --optimizer`` wrote of ``OUT/ckpt``
  (``read_handoff_optimizer``, ``load_optimizer_state``: masters, moments and step counts; the frozen layer and
  the buffers are the new engine's, as initialised), recorded in ``OUT/form-<world size>.safetensors``.
Rank 0 prints ``DONE {"seconds": load time, "peak_rss_mib": this process's peak, "load_peak_extra_mib": the
resident memory the load added at its peak (tests/scripts/host_peak.py), ...}``: a benchmark too, with
``--model big``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from host_peak import RssPeak  # noqa: E402
from make_zero_checkpoint import BigNet, TinyNet  # noqa: E402


def engine_for(args: argparse.Namespace):
    import deepspeed

    torch.manual_seed(1234)
    model = BigNet(args.hidden, args.layers) if args.model == "big" else TinyNet()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=0.05
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def step(engine, args: argparse.Namespace, n: int) -> None:
    torch.manual_seed(99)
    batch = torch.randn(4, args.hidden) if args.model == "big" else torch.randint(0, 37, (4, 5))
    if batch.is_floating_point() and args.dtype == "bf16":
        batch = batch.to(torch.bfloat16)
    for i in range(n):
        loss = engine(batch).float().pow(2).mean() + i
        engine.backward(loss)
        engine.step()


def record(engine, path: str) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO 1/2 links each parameter to its optimizer state at its first step, after the
        # first param group stepped (the others' state not made yet): linked again now, to read it
        engine.optimizer._hp_optimizer_states_linked = False
        link()
    values = {}
    for name, param in engine.module.named_parameters():  # a tied weight once
        if not param.requires_grad:
            continue
        values[f"master/{name}"] = safe_get_full_fp32_param(param).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            values[f"{key}/{name}"] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:  # a frozen one, gathered whole
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                values[f"frozen/{name}"] = param.detach().float().cpu().clone()
    if torch.distributed.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in values.items()}, path)
    torch.distributed.barrier()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=("save", "ours", "stock", "form"))
    parser.add_argument("out")
    parser.add_argument("stage", type=int)
    parser.add_argument("--model", choices=("tiny", "big"), default="tiny")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--no-record", action="store_true", help="time the load only")
    parser.add_argument("--stepped", action="store_true",
                        help="the new engine takes a step before the load: it holds its optimizer state")
    args = parser.parse_args()

    import deepspeed

    deepspeed.init_distributed("gloo")
    world = torch.distributed.get_world_size()
    engine = engine_for(args)
    seconds = 0.0
    load = RssPeak()
    if args.phase == "save":
        step(engine, args, 2)
        if not args.no_record:
            record(engine, f"{args.out}/saved.safetensors")
        engine.save_checkpoint(f"{args.out}/ckpt")
    else:
        from stagesafe.zero.engine import (  # imported before the clock, as DeepSpeed's
            load_optimizer_state,
            load_rank_files,
            read_handoff_optimizer,
            read_rank_files,
        )

        if args.stepped:
            step(engine, args, 1)
        torch.distributed.barrier()
        load.start()
        start = time.perf_counter()
        if args.phase == "ours":
            files, _ = read_rank_files(engine, f"{args.out}/ckpt")
            load_rank_files(engine, files)
            del files
        elif args.phase == "form":
            load_optimizer_state(engine, read_handoff_optimizer(engine, f"{args.out}/form"))
        else:
            engine.load_checkpoint(f"{args.out}/ckpt")
        torch.distributed.barrier()
        seconds = time.perf_counter() - start
        load.stop()
        if not args.no_record:
            record(engine, f"{args.out}/{args.phase}-{world}.safetensors")
        step(engine, args, 1)  # training goes on
    peak = max(load.earlier / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if torch.distributed.get_rank() == 0:
        facts = {"seconds": seconds, "peak_rss_mib": peak, "rss_before_load_mib": load.before / 2**20,
                 "load_peak_extra_mib": (load.peak - load.before) / 2**20, "rss_after_load_mib": load.after / 2**20}
        print("DONE " + json.dumps(facts), flush=True)
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # as make_zero_checkpoint.py: gloo's threads sometimes abort at interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
