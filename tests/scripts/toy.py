"""A small LightningModule and data for the Trainer-sequence scripts, plus the probes they record.

Odd sizes so ZeRO-3 pads its partitions; an embedding (the ``index_select`` of the GPU crash); a buffer;
one user forward hook whose survival the tests check.
"""

from __future__ import annotations

import hashlib

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, HIDDEN = 37, 24, 19


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.register_buffer("scale", torch.full((HIDDEN,), 0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.norm(self.hidden(self.embed(tokens))))
        return self.head(hidden * self.scale.to(hidden.dtype))


class ToyModule(pl.LightningModule):
    def __init__(
        self,
        backbone: nn.Module | None = None,
        lr: float = 0.1,
        frozen_hidden: bool = False,
        fail_at_step: int | None = None,
        extra_head: bool = False,
        in_configure_model: bool = False,
    ) -> None:
        """``in_configure_model``: the backbone is built in ``configure_model`` (under DeepSpeed's ``zero.Init``,
        Lightning's way to build a model too large for one device), once; else here."""
        super().__init__()
        self.lr = lr
        self.fail_at_step = fail_at_step
        self.frozen_hidden = frozen_hidden
        self.extra_head = nn.Linear(VOCAB, VOCAB) if extra_head else None
        self.user_hook_calls = 0
        self.backbone = None
        if backbone is not None or not in_configure_model:
            self._adopt(backbone if backbone is not None else Backbone())

    def configure_model(self) -> None:
        if self.backbone is None:
            self._adopt(Backbone())

    def _adopt(self, backbone: nn.Module) -> None:
        self.backbone = backbone
        self.backbone.register_forward_hook(self._user_hook)
        if self.frozen_hidden:
            self.backbone.hidden.requires_grad_(False)

    def _user_hook(self, module, args, output) -> None:
        self.user_hook_calls += 1

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.backbone(tokens)
        return out if self.extra_head is None else self.extra_head(out)

    def _loss(self, batch) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).float(), targets)

    def training_step(self, batch, batch_idx):
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise RuntimeError(f"planned failure in training_step at step {self.global_step}")
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def dataloader(n: int = 32, batch_size: int = 4) -> DataLoader:
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (n,), generator=generator)
    targets = torch.randint(0, VOCAB, (n,), generator=generator)
    return DataLoader(TensorDataset(tokens, targets), batch_size=batch_size, shuffle=False)


def state_digest(module: nn.Module) -> str:
    """sha256 over names, dtypes, shapes and bytes of the state dict: equal digests mean bitwise equal."""
    return state_digest_of(module.state_dict())


def state_digest_of(state_dict: dict) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(state_dict.items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def probe(module: nn.Module) -> dict:
    """What a user would see of the module after a stage."""
    ds_attrs = 0
    for p in module.parameters():
        ds_attrs += sum(1 for k in vars(p) if k.startswith("ds_"))
    for m in module.modules():
        ds_attrs += sum(1 for k in vars(m) if k.startswith("ds_"))
    hooks = [h for m in module.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    deepspeed_hooks = sum(1 for h in hooks if getattr(h, "__module__", "").startswith("deepspeed"))
    params = list(module.parameters())
    return {
        "ds_attrs": ds_attrs,
        "forward_hooks": len(hooks),
        "deepspeed_hooks": deepspeed_hooks,
        "user_hooks": len(hooks) - deepspeed_hooks,
        "min_numel": min(p.numel() for p in params),
        "dtypes": sorted({str(p.dtype) for p in params}),
        "devices": sorted({str(p.device) for p in params}),
        "digest": state_digest(module) if all(p.numel() and p.device.type != "meta" for p in params) else None,
    }


def quiet_trainer(
    root: str, name: str, *, devices: int, max_steps: int = -1, accelerator: str = "cpu", **strategy_kwargs
) -> pl.Trainer:
    """A one-epoch bf16 Trainer under StageSafeDeepSpeedStrategy (ZeRO-3) on CPU processes (or ``accelerator``),
    with nothing printed or saved but the handoff (``<root>/<name>/handoff`` unless ``handoff_uri`` is given)."""
    from stagesafe import StageSafeDeepSpeedStrategy

    strategy_kwargs.setdefault("handoff_uri", f"{root}/{name}/handoff")
    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=StageSafeDeepSpeedStrategy(stage=3, **strategy_kwargs),
        precision="bf16-mixed",
        max_epochs=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=f"{root}/{name}",
    )
