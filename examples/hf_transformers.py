"""A Hugging Face ``transformers`` model trained under stagesafe ZeRO-3, then loaded back with ``from_pretrained``.

    DS_ACCELERATOR=cpu python examples/hf_transformers.py [--out DIR] [--devices 2]

1. Builds a tiny Llama (2 layers, hidden size 32) from a local ``LlamaConfig``: no download, no network.
2. Fits it for a couple of steps with ``stagesafe_deepspeed_stage_3`` on CPU; the strategy writes the handoff.
3. Adds ``config.json`` to that handoff folder and loads it directly with ``LlamaForCausalLM.from_pretrained``:
   a handoff is Hugging Face's sharded layout (safetensors shards + ``model.safetensors.index.json``);
   ``key_mapping`` drops the ``model.`` prefix that the LightningModule's attribute adds to every name.
4. Writes a stand-alone Hugging Face folder (``config.json`` + shards) with ``stagesafe.save_state_dict``, and
   loads it with plain ``from_pretrained(folder)``, as any ``transformers`` user or tool would.

Both loaded models must hold the trained module's weights bit for bit and give the same logits.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never reach for the Hub

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

import stagesafe

VOCAB, SEQ = 128, 16


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
    )


class CausalLM(pl.LightningModule):
    """Any ``transformers`` causal LM as a LightningModule; its weights live under the prefix ``model.``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g)), batch_size=4)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "stagesafe-hf"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    handoff_uri = os.path.join(args.out, "handoff")

    pl.seed_everything(0, verbose=False)
    config = tiny_llama_config()
    module = CausalLM(config)
    trainer = pl.Trainer(
        strategy=stagesafe.StageSafeDeepSpeedStrategy(stage=3, handoff_uri=handoff_uri),
        accelerator=args.accelerator, devices=args.devices, precision="bf16-mixed", max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=args.out,
    )
    trainer.fit(module, train_dataloaders=data())
    # fit returned as soon as the module held its weights; the handoff is written in the background. A reader
    # outside stagesafe (transformers here) needs it committed first: join the write, on every rank.
    trainer.strategy.wait_for_handoff()
    if trainer.global_rank != 0:
        return
    trained = module.model.eval()  # plain tensors again, fp32, on the CPU: no DeepSpeed state left

    # The handoff folder as the strategy wrote it, plus config.json, read by transformers itself. (The store
    # leaves files it did not write alone, so config.json survives later handoffs into the same folder.)
    config.save_pretrained(handoff_uri)
    direct = LlamaForCausalLM.from_pretrained(handoff_uri, key_mapping={r"^model\.": ""}).eval()

    # A stand-alone Hugging Face folder: config.json + safetensors shards + index, nothing stagesafe-specific
    # needed to read it. Small shards here only to show that sharded folders load too.
    hf_dir = os.path.join(args.out, "hf_model")
    weights = stagesafe.load_state_dict(handoff_uri)  # every shard checked against its digest first
    hf_weights = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
    stagesafe.save_state_dict(hf_weights, hf_dir, max_shard_size="20KB", overwrite=True, metadata={"source": handoff_uri})
    config.save_pretrained(hf_dir)
    standalone = LlamaForCausalLM.from_pretrained(hf_dir).eval()

    tokens = next(iter(data()))[0]
    with torch.no_grad():
        logits = trained(input_ids=tokens).logits
        same_logits = all(torch.equal(logits, m(input_ids=tokens).logits) for m in (direct, standalone))
    shards = len(stagesafe.read_manifest(hf_dir)["shards"])
    print(f"trained {trainer.global_step} steps of a {sum(p.numel() for p in trained.parameters())}-parameter Llama "
          f"with ZeRO-3 on {args.devices} x {args.accelerator}; handoff at {handoff_uri}")
    print(f"from_pretrained(handoff, key_mapping=...): same weights {same_weights(trained, direct)}")
    print(f"from_pretrained({hf_dir}) ({shards} shards + config.json): same weights {same_weights(trained, standalone)}")
    print(f"same logits: {same_logits}")


if __name__ == "__main__":
    main()
