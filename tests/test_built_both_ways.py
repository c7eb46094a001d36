"""A module whose backbone ``configure_model`` builds (under ``zero.Init``) beside a head ``__init__`` builds, under
``bf16-mixed``: DeepSpeed casts a module to 16 bits only where zero.Init built none of its parameters, so the head
stayed fp32 and the first forward failed ("mat1 and mat2 must have the same dtype"). The strategy casts the head
for the engine; it comes back in fp32 with its values. One rank in this process, on the CPU and on a GPU. (Two CPU
ranks, beside stock's failure: ``tests/test_trainer_sequences.py``.)"""

from __future__ import annotations

import os

import pytest
import torch
from _tensors import assert_bitwise_equal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _built_both_ways(root, accelerator: str):
    import lightning.pytorch as pl
    from torch import nn

    from stagesafe import StageSafeDeepSpeedStrategy

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 2)

        def configure_model(self) -> None:
            if not hasattr(self, "backbone"):
                self.backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU())

        def forward(self, x):
            return self.head(self.backbone(x))

        def training_step(self, batch, index):
            return self(batch[0]).float().square().mean()

        validation_step = test_step = training_step

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.0)  # the weights stay as they are: compared bitwise

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    strategy = StageSafeDeepSpeedStrategy(
        stage=3, wait_for_write=True, handoff_uri=os.path.join(str(root), "handoff"), overwrite_handoff=True,
        config={"zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3},
                "train_micro_batch_size_per_gpu": 2})
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=2, precision="bf16-mixed",
                         default_root_dir=str(root), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    return Model(), trainer, data


def _run_and_check(root, accelerator: str) -> None:
    import stagesafe

    model, trainer, data = _built_both_ways(root, accelerator)
    head = {name: t.clone() for name, t in model.head.state_dict().items()}
    trainer.validate(model, data)
    trainer.fit(model, data)
    trainer.test(model, data)
    assert {n: (p.dtype, p.device.type) for n, p in model.named_parameters()} == {
        "head.weight": (torch.float32, "cpu"), "head.bias": (torch.float32, "cpu"),
        "backbone.0.weight": (torch.bfloat16, "cpu"), "backbone.0.bias": (torch.bfloat16, "cpu"),
    }
    assert_bitwise_equal(dict(model.head.state_dict()), head)  # cast for the engine, given back exactly
    handoff = stagesafe.load_state_dict(os.path.join(str(root), "handoff"))
    assert_bitwise_equal({n: handoff[f"head.{n}"] for n in head}, head)  # the fit's masters started from them
    assert handoff["backbone.0.weight"].dtype == torch.float32  # the backbone's masters


def test_a_module_built_both_ways_runs_under_bf16_and_keeps_its_fp32_head(in_process):
    _run_and_check(in_process, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_module_built_both_ways_runs_under_bf16_and_keeps_its_fp32_head(in_process):
    os.environ.pop("DS_ACCELERATOR", None)  # DeepSpeed's own: the GPU
    _run_and_check(in_process, "gpu")
