"""``StageSafeDeepSpeedStrategy``: Lightning's DeepSpeed strategy, safe to reuse a module across Trainer calls.

Thin glue: each override hands the work to :mod:`stagesafe.lightning.boundary`, which knows nothing of Lightning.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
from typing import Any, Mapping, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.nn import Module
from typing_extensions import override

from stagesafe.zero import engine as _zero
from stagesafe.lightning.cpu import CPUCapableDeepSpeedStrategy
from stagesafe.lightning.boundary import BoundaryReport, HandoffTarget, StageBoundary

__all__ = ["StageSafeDeepSpeedStrategy"]

log = logging.getLogger(__name__)

_DEFAULT_HANDOFF_DIR = "stagesafe_handoff"


class StageSafeDeepSpeedStrategy(CPUCapableDeepSpeedStrategy):
    """DeepSpeed (ZeRO 1, 2 or 3) for any sequence of ``fit``/``validate``/``test``/``predict`` on one module.

    At the end of every Trainer call the weights are consolidated, written as safetensors to ``handoff_uri``,
    the engine is destroyed and the module gets plain tensors back in its original dtype and device. Takes
    every argument of :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`, plus:

    Args:
        handoff_uri: fsspec URL of the handoff folder; default ``<default_root_dir>/stagesafe_handoff``.
        storage_options: passed to fsspec for ``handoff_uri`` (credentials, endpoint, ...).
        max_shard_size: largest safetensors shard, e.g. ``"5GB"`` or a byte count. Smaller shards are hashed
            and written in parallel.
        resume_from: fsspec URL of a handoff (from an earlier job, any world size) whose weights a module
            takes before its first stage under stagesafe; read with ``storage_options``.
        restore: ``"cpu"`` (default): after each stage the module holds real tensors. ``"meta"``: it holds meta
            tensors (no host memory); the next stage's engine is built from the handoff one submodule at a time,
            and a trained stage's weights are gathered and written one tensor at a time (ZeRO-3 only).
            ``stagesafe.restore(module, uri)`` materialises the module on demand.
        wait_for_write: ``False`` (default): a Trainer call returns as soon as the module holds its weights;
            the handoff's durable write goes on in the background (each rank writes its share of the shards,
            from private copies) and is joined by the next stage, by :meth:`wait_for_handoff`, or at
            interpreter exit. Readers of the handoff in this process wait for it. ``True``: each call returns
            once its handoff is committed.
    """

    strategy_name = "stagesafe_deepspeed"

    def __init__(
        self,
        *args: Any,
        handoff_uri: Optional[str] = None,
        storage_options: Optional[Mapping[str, Any]] = None,
        max_shard_size: Union[int, str] = "1GB",
        resume_from: Optional[str] = None,
        restore: str = "cpu",
        wait_for_write: bool = False,
        config: Optional[Union[_PATH, dict[str, Any]]] = None,
        **kwargs: Any,
    ) -> None:
        # Lightning writes into the config it is given; a copy keeps the caller's dict reusable.
        super().__init__(*args, config=copy.deepcopy(config), **kwargs)
        for name, value in (("handoff_uri", handoff_uri), ("resume_from", resume_from)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name} must be a str URL or path, got {type(value).__name__}: {value!r}")
        self.handoff_uri = None if handoff_uri is None else os.fspath(handoff_uri)
        self.resume_from = None if resume_from is None else os.fspath(resume_from)
        if restore not in ("cpu", "meta"):
            raise ValueError(f"restore={restore!r}: choose 'cpu' (real tensors between stages) or 'meta' (none)")
        if restore == "meta" and isinstance(self.config, dict) and not self.zero_stage_3:
            raise ValueError(
                "restore='meta' needs ZeRO stage 3 (stage=3): stages 1 and 2 keep whole weights on every rank, so an "
                "engine cannot be built from the handoff one submodule at a time; use restore='cpu'"
            )
        self.restore_mode = restore
        if not isinstance(wait_for_write, bool):
            raise TypeError(f"wait_for_write must be True or False, got {wait_for_write!r}")
        self.wait_for_write = wait_for_write
        self.storage_options = dict(storage_options or {})
        self.max_shard_size = max_shard_size
        self._boundary: Optional[StageBoundary] = None
        self._publishing: Optional[StageBoundary] = None
        self.last_boundary: Optional[BoundaryReport] = None

    # -- entering a stage -------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        module = self.lightning_module
        assert module is not None
        meta = self.restore_mode == "meta"
        boundary = StageBoundary(
            module,
            self._handoff_target(trainer),
            trainer.state.fn.value,
            meta=meta,
            materialize=self._partition_from_handoff if meta else None,
            training=trainer.state.fn == TrainerFn.FITTING,
            device=self.root_device,
            background=not self.wait_for_write,
            single_node=self.num_nodes == 1,
        )
        resume = None
        if self.resume_from is not None:
            resume = HandoffTarget(uri=self.resume_from, storage_options=self.storage_options)
        boundary.enter(self._metadata(trainer), resume_from=resume)  # refuses a stale module before changing it
        self._boundary = boundary
        if not any(isinstance(cb, _WaitForHandoff) for cb in trainer.callbacks):
            trainer.callbacks.append(_WaitForHandoff())
        super().setup(trainer)
        self._boundary.engine_built(training=trainer.state.fn == TrainerFn.FITTING)

    def _partition_from_handoff(self, values: Mapping[str, Any]) -> None:
        """Build ZeRO-3 partitions for a meta module from the handoff, in the dtype the engine computes in."""
        import torch

        self._init_config_if_needed()
        assert isinstance(self.config, dict)
        if not self.zero_stage_3:
            raise ValueError("restore='meta' needs ZeRO stage 3: stages 1 and 2 keep whole weights on every rank")
        enabled = {key for key in ("bf16", "fp16") if self.config.get(key, {}).get("enabled")}
        dtype = torch.bfloat16 if "bf16" in enabled else torch.float16 if "fp16" in enabled else torch.float32
        _zero.partition_from_values(
            self.lightning_module, values, config=self.config, dtype=dtype, device=self.root_device
        )

    def _handoff_target(self, trainer: "pl.Trainer") -> HandoffTarget:
        uri = self.handoff_uri
        if uri is None:
            root = str(trainer.default_root_dir)
            uri = root.rstrip("/") + "/" + _DEFAULT_HANDOFF_DIR
        return HandoffTarget(uri=uri, storage_options=self.storage_options, max_shard_size=self.max_shard_size)

    def _metadata(self, trainer: "pl.Trainer") -> dict[str, Any]:
        return {
            "global_step": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "world_size": int(self.world_size),
            "zero_stage": int((self.config or {}).get("zero_optimization", {}).get("stage", 0)),
        }

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        """Lightning's version, minus three faults: it read ``zero_allow_untested_optimizer`` unguarded,
        and it wiped every module hook (the user's too) to get rid of an earlier engine's, which
        the strategy now removes by handle at the end of each stage."""
        import deepspeed

        assert isinstance(self.config, dict)
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = copy.deepcopy(self.config[key])
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config.get("zero_allow_untested_optimizer", True)
            inference_config["zero_optimization"] = copy.deepcopy(self.config["zero_optimization"])
        engine, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.root_device.index),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
        self.model = engine

    # -- checkpoints ------------------------------------------------------------------------------------------
    @property
    def _fitting(self) -> bool:
        return self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING

    @property
    def _engine_is_live(self) -> bool:
        return _zero.is_engine(self.model)

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """During a stage: DeepSpeed's sharded checkpoint. Between stages (no engine): one full-weights file."""
        if self._engine_is_live:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        Strategy.save_checkpoint(self, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        fitting = self._fitting
        if os.path.isfile(os.fspath(checkpoint_path)):
            # A full-weights file (written between stages, or by load_full_weights users)
            return Strategy.load_checkpoint(self, checkpoint_path, weights_only)
        if fitting:
            return super().load_checkpoint(checkpoint_path, weights_only)
        # DeepSpeed cannot load a checkpoint into an inference engine (its ZeRO-Offload optimizer has no
        # _restore_from_bit16_weights): read the fp32 weights ourselves and load them into the partitions.
        from stagesafe.consolidate import load_zero_checkpoint_with_client_state

        values, client_state = load_zero_checkpoint_with_client_state(os.fspath(checkpoint_path))
        client_state = dict(client_state)
        client_state["state_dict"] = values
        return client_state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state_dict = checkpoint.get("state_dict")
        if state_dict is None or self._boundary is None:
            return  # DeepSpeed's own load_checkpoint already put the weights (and masters) in the engine
        fitting = self._fitting
        _check_keys(self.lightning_module, state_dict, strict)
        self._boundary.checkpoint_loaded(state_dict, self.lightning_module, training=fitting)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    # -- leaving a stage --------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        boundary, self._boundary = self._boundary, None
        try:
            if boundary is not None:
                engine = self.model if self._engine_is_live else None
                trainer = self.lightning_module.trainer if self.lightning_module is not None else None
                trained = trainer is not None and trainer.state.fn == TrainerFn.FITTING
                metadata = self._metadata(trainer) if trainer is not None else {}
                # After a failure, publish before raising; otherwise overlap the upload with the rest of
                # Lightning's teardown and join it in the Trainer's last hook (_WaitForHandoff).
                background = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
                try:
                    self.last_boundary = boundary.exit(
                        engine, trained=trained, metadata=metadata, background=background
                    )
                except Exception as exc:
                    if trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED:
                        raise
                    # The stage already failed: that error is the one to raise, not this consequence of it.
                    log.error("stagesafe: after the stage failed, its boundary failed too: %s", exc, exc_info=exc)
                    self.last_boundary = boundary.report
                self.model = boundary.module
                self.optimizers = []
                self.lr_scheduler_configs = []
                self._publishing = boundary
                if not background:
                    self.wait_for_handoff()
        finally:
            super().teardown()
            if boundary is not None:
                boundary.place_meta()

    def wait_for_handoff(self) -> None:
        """Return once the last stage's handoff is committed (raise its failure on every rank). A collective:
        call it on every rank, e.g. before another process reads the handoff."""
        StageBoundary.call_returned()
        boundary, self._publishing = self._publishing, None
        if boundary is not None:
            boundary.wait_published()
            self._log_boundary(boundary.report, waited=True)
        elif self.lightning_module is not None:
            StageBoundary.wait_for_module(self.lightning_module)

    def _log_boundary(self, report: BoundaryReport, *, waited: bool) -> None:
        if not self.is_global_zero:
            return
        if report.wrote and not waited:
            written = "being written in the background"
        else:
            written = "written" if report.wrote else ("written on entry" if report.enter_wrote else "unchanged")
        log.info(
            "stagesafe: %s boundary %.2fs (waited %.2fs for the write); handoff %s at %s%s%s",
            report.stage,
            report.seconds,
            report.phases.get("publish_wait", 0.0),
            written,
            report.uri,
            f" ({report.handoff_bytes / 1e6:.1f} MB)" if report.handoff_bytes else "",
            "" if report.clean else f"; NOT clean: {report.stale_problems}",
        )

    def _stage_returned(self) -> None:
        """The Trainer call is about to return: join the write if asked to, else only report the boundary."""
        if self.wait_for_write:
            self.wait_for_handoff()
            return
        StageBoundary.call_returned()  # Lightning's teardown is over: its CUDA calls no longer wait for the driver
        boundary = self._publishing
        if boundary is not None:
            self._log_boundary(boundary.report, waited=False)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:  # type: ignore[override]
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"stagesafe_deepspeed_stage_{stage}",
                cls,
                description=f"stagesafe: DeepSpeed ZeRO stage {stage}",
                stage=stage,
            )
        strategy_registry.register(
            "stagesafe_deepspeed_stage_2_offload",
            cls,
            description="stagesafe: DeepSpeed ZeRO stage 2 with CPU optimizer offload",
            stage=2,
            offload_optimizer=True,
        )
        strategy_registry.register(
            "stagesafe_deepspeed_stage_3_offload",
            cls,
            description="stagesafe: DeepSpeed ZeRO stage 3 with CPU offload",
            stage=3,
            offload_optimizer=True,
            offload_parameters=True,
        )


class _WaitForHandoff(Callback):
    """The Trainer's last hook of a call (after the strategy's teardown): with ``wait_for_write=True`` the call
    returns only once the handoff is committed, and a write failure is raised from it."""

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, StageSafeDeepSpeedStrategy):
            strategy._stage_returned()


def _check_keys(module: Optional[Module], state_dict: Mapping[str, Any], strict: bool) -> None:
    """Refuse a checkpoint that does not fit the module, before anything is loaded."""
    if module is None or not strict:
        return
    from stagesafe.restore import check_fits

    check_fits(module, state_dict)


StageSafeDeepSpeedStrategy.register_strategies(StrategyRegistry)
