"""Build real DeepSpeed ZeRO checkpoints on CPU; run as N ranks (tests/_launch.py: run_ranks).

One launch writes several checkpoints under OUT, one engine after another in the same process group, so the
cost of starting DeepSpeed is paid once:

    OUT/<name>/            engine.save_checkpoint(OUT/<name>) layout: ``latest`` + ``global_step<N>/``
    OUT/<name>.ckpt/       Lightning layout (``trainer.save_checkpoint`` under DeepSpeedStrategy): ``latest`` +
                           ``checkpoint/``, with Lightning's client state beside the DeepSpeed keys

A spec is ``name:stage=S,dtype=fp32|bf16|fp16[,layout=engine|lightning]``. DeepSpeed's CPU accelerator says
fp16 is unsupported where oneDNN lacks fp16 kernels; for ``dtype=fp16`` it is told otherwise, and torch's CPU
fp16 ops run the steps (DynamicLossScaler, fp16 model states: what a GPU run saves). The default model (``--model tiny``) has
a tied weight (head.weight is embed.weight), a frozen layer, a float and an integer buffer, two optimizer param
groups, and parameter sizes not divisible by the world size so partition padding is exercised. ``--model big``
(with ``--hidden``/``--layers``) is the benchmark's model. Rank 0 prints one line ``DONE <json>`` at the end.

    RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 DS_ACCELERATOR=cpu \\
        python tests/scripts/make_zero_checkpoint.py OUT s3:stage=3,dtype=fp32 &  # and RANK=1 likewise
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn


class TinyNet(nn.Module):
    """Small model with every shape of state a ZeRO checkpoint can hold."""

    def __init__(self, vocab: int = 37, hidden: int = 13):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)  # 481 elements: odd, so ZeRO pads the partitions
        self.frozen = nn.Linear(hidden, hidden)  # requires_grad=False: saved as frozen_param_fragments
        self.body = nn.Linear(hidden, 7)
        self.out = nn.Linear(7, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: DeepSpeed records it in shared_params
        self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden))
        self.register_buffer("counter", torch.tensor([3, 1, 4], dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)  # not saved, must not appear
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) * self.scale.to(self.embed.weight.dtype)
        h = torch.tanh(self.frozen(h))
        h = self.out(torch.relu(self.body(h)))
        return self.head(h)


class BigNet(nn.Module):
    """A stack of square linear layers, for benchmarks: hidden*hidden*layers parameters, roughly."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.register_buffer("scale", torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * self.scale.to(x.dtype)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    opts = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, opts


def lightning_client_state(global_step: int) -> dict:
    """What Lightning's DeepSpeedStrategy.save_checkpoint passes as client_state (its dict minus weights)."""
    try:
        from lightning.fabric.utilities.data import AttributeDict
    except ImportError:  # pragma: no cover - the test environment has lightning
        AttributeDict = dict
    return {
        "epoch": 0,
        "global_step": global_step,
        "pytorch-lightning_version": "2.6.6",
        "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.state_dict": {"_batches_that_stepped": global_step}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': None, 'mode': 'min'}": {
                "best_model_score": None,
                "best_model_path": "",
                "dirpath": "/tmp/checkpoints",
                "best_k_models": {},
                "last_model_path": "",
            }
        },
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": AttributeDict(lr=0.05, hidden=13),
    }


def build_one(out: str, name: str, opts: dict[str, str], args: argparse.Namespace) -> dict:
    import deepspeed

    stage = int(opts.get("stage", "3"))
    dtype = opts.get("dtype", "fp32")
    layout = opts.get("layout", "engine")
    torch.manual_seed(1234)
    if args.model == "big":
        model = BigNet(args.hidden, args.layers)
        batch = torch.randn(4, args.hidden)
    else:
        model = TinyNet()
        batch = torch.randint(0, 37, (4, 5))
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=0.05
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True  # see the module docstring
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    in_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    for step in range(args.steps):
        x = batch if batch.dtype == torch.int64 else batch.to(in_dtype)
        loss = engine(x).float().pow(2).mean() + step
        engine.backward(loss)
        engine.step()
    if layout == "lightning":
        path = os.path.join(out, f"{name}.ckpt")
        engine.save_checkpoint(path, client_state=lightning_client_state(args.steps), tag="checkpoint")
    else:
        path = os.path.join(out, name)
        engine.save_checkpoint(path)
    engine.destroy()
    return {"name": name, "path": path, "stage": stage, "dtype": dtype, "layout": layout}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("specs", nargs="+", help="name:stage=S,dtype=fp32|bf16|fp16[,layout=engine|lightning]")
    parser.add_argument("--model", choices=("tiny", "big"), default="tiny")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    import deepspeed

    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    made = [build_one(args.out, *parse_spec(spec), args) for spec in args.specs]
    torch.distributed.barrier()
    if rank == 0:
        print("DONE " + json.dumps(made), flush=True)
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with 3 gloo ranks on 2 cores, a communication thread sometimes aborts in its
    # C++ destructor at exit ("terminate called without an active exception") after all the work is done.
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # here, not at import: a GPU script imports the models
    sys.exit(main())
