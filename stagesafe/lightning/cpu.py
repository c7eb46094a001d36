"""DeepSpeed on CPU processes (gloo) under Lightning, for debugging a ZeRO pipeline on a laptop or in CI.

Lightning's DeepSpeedStrategy refuses ``accelerator="cpu"`` in three places although DeepSpeed ZeRO runs on
CPU: a CUDA check in ``setup_environment``, the device-index check in ``setup_distributed`` (a CPU device has
no index) and ``device_rank=None`` reaching ``DeepSpeedEngine``. Giving each process the device ``cpu:<local
rank>`` satisfies the last two; this class skips the first and selects DeepSpeed's CPU accelerator. It adds
nothing else, so it is also the "stock" baseline the test suite compares against.
"""

from __future__ import annotations

import os

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from typing_extensions import override

__all__ = ["CPUCapableDeepSpeedStrategy", "use_deepspeed_cpu_accelerator"]


def use_deepspeed_cpu_accelerator() -> None:
    """Make DeepSpeed run its kernels and collectives on the CPU (gloo), whatever it detected before."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


class CPUCapableDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy, unchanged except that ``accelerator="cpu"`` works."""

    @override
    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            super().setup_environment()
            return
        use_deepspeed_cpu_accelerator()
        assert self.parallel_devices is not None
        self.parallel_devices = [torch.device("cpu", index) for index in range(len(self.parallel_devices))]
        DDPStrategy.setup_environment(self)  # skip DeepSpeedStrategy's CUDA-only check
