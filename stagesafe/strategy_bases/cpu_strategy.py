"""DeepSpeed on CPU processes (gloo) under Lightning, for debugging a ZeRO pipeline on a laptop or in CI.

Lightning's DeepSpeedStrategy refuses ``accelerator="cpu"`` in three places although DeepSpeed ZeRO runs on
CPU: a CUDA check in ``setup_environment``, the device-index check in ``setup_distributed`` (a CPU device has
no index) and ``device_rank=None`` reaching ``DeepSpeedEngine``. Giving each process the device ``cpu:<local
rank>`` satisfies the last two; this class lifts the first when the user asked for DeepSpeed's CPU
accelerator with ``DS_ACCELERATOR=cpu`` (DeepSpeed's own switch), and otherwise refuses as Lightning does. It
changes nothing else, the process environment included, so it is also the "stock" baseline the test suite
compares against.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from stagesafe.strategy_bases.comm_op_build import watch_comm_op_build

log = logging.getLogger(__name__)

__all__ = ["CPUCapableDeepSpeedStrategy", "use_deepspeed_cpu_accelerator", "cpu_requested"]

_HINT = (
    "To run DeepSpeed on CPU processes (gloo), as stagesafe's strategy can, set DS_ACCELERATOR=cpu in the "
    "environment before starting the script."
)


def cpu_requested() -> bool:
    """The user asked DeepSpeed for its CPU accelerator."""
    return os.environ.get("DS_ACCELERATOR") == "cpu"


def use_deepspeed_cpu_accelerator() -> None:
    """Make DeepSpeed run its kernels and collectives on the CPU (gloo), whatever it detected before."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


class CPUCapableDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy, unchanged except that ``accelerator="cpu"`` works with DS_ACCELERATOR=cpu."""

    @override
    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            super().setup_environment()
            return
        if not cpu_requested():
            try:
                super().setup_environment()  # Lightning's refusal of the CPU
            except RuntimeError as exc:
                raise RuntimeError(f"{exc} {_HINT}") from None  # Lightning's sentence, then the hint
            return
        use_deepspeed_cpu_accelerator()
        assert self.parallel_devices is not None
        self.parallel_devices = [torch.device("cpu", index) for index in range(len(self.parallel_devices))]
        DDPStrategy.setup_environment(self)  # skip DeepSpeedStrategy's CUDA-only check

    @override
    def _init_deepspeed_distributed(self) -> None:
        """On the CPU, DeepSpeed's comm backend prints "... built successfully" on every rank once it has
        loaded its shared-memory op; that line is left out, anything else it prints is logged. A build of
        the op (missing or stale) is said on rank 0 (:mod:`stagesafe.strategy_bases.comm_op_build`)."""
        if not isinstance(self.accelerator, CPUAccelerator):
            super()._init_deepspeed_distributed()
            return
        printed = io.StringIO()
        try:
            with watch_comm_op_build(rank_zero_info), contextlib.redirect_stdout(printed):
                super()._init_deepspeed_distributed()
        finally:
            for line in printed.getvalue().splitlines():
                if line.strip() and "built successfully" not in line:
                    log.info("deepspeed: %s", line)
