"""The strategy's checkpoint hooks: ``trainer.save_checkpoint`` during a stage (DeepSpeed's own) and between
calls (:mod:`~stagesafe.stages.between_calls_checkpoint`), a ``ckpt_path`` read into this job's engine
(:mod:`~stagesafe.stages.checkpoint_loading`) and handed to the stage boundary, and the engine that a checkpoint
callback asks for, which is gone between calls."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from lightning.fabric.strategies.deepspeed import _validate_checkpoint_directory
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies.deepspeed import warning_cache
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from stagesafe.strategy_bases.cpu_strategy import CPUCapableDeepSpeedStrategy
from stagesafe.errors import EngineReleasedError
from stagesafe.stages.between_calls_checkpoint import save_between_calls
from stagesafe.stages.call_series import CallSeries
from stagesafe.stages.checkpoint_loading import check_keys, load_training_checkpoint, read_weights_checkpoint
from stagesafe.zero import engine as zero_engine
from stagesafe.zero.checkpoint_writer import holds_optimizer_state, is_weights_only

__all__ = ["CheckpointHooks"]


class CheckpointHooks(CPUCapableDeepSpeedStrategy):
    """Lightning's DeepSpeed strategy whose checkpoints work between Trainer calls too, when no engine lives."""

    call_series: CallSeries  # what the strategy's Trainer calls share: the call under way's boundary among it

    @property
    def _fitting(self) -> bool:
        return self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING

    @property
    def _engine_is_live(self) -> bool:
        return zero_engine.is_engine(self.model)

    @property
    @override
    def deepspeed_engine(self) -> Any:
        """The engine of the Trainer call under way. After a call it is gone: stagesafe destroys it when the
        call returns, and says so here rather than handing out the bare module as if it were the engine."""
        series = self.call_series
        if self._engine_is_live or series.calls == 0 or series.boundary is not None:
            return self.model
        uri = series.last_report.uri if series.last_report is not None else None
        raise EngineReleasedError(
            "the DeepSpeed engine was destroyed when the last Trainer call returned (StageSafeDeepSpeedStrategy "
            "gives the module back with its weights, and builds a new engine at the next call). Use the module "
            "itself (trainer.lightning_module) for its weights"
            + (f", the handoff at {uri!r} (stagesafe.load_state_dict(uri)) for a checkpoint of them" if uri else "")
            + ", or trainer.save_checkpoint(path) for DeepSpeed's checkpoint folder with the optimizer state the "
            "last fit ended with"
        )

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """During a stage: DeepSpeed's sharded checkpoint. Between stages (no engine): the files the last
        ``fit``'s engine would have written at its end (every rank its own, optimizer state included), kept
        since; without them (a module changed since, ``keep_optimizer_state=False``), the same folder layout
        with weights only, written by rank 0, with a warning that names what is missing."""
        if self._engine_is_live:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            if self.is_global_zero:  # rank 0's path is the one stock broadcast; DeepSpeed wrote 'latest' there
                holds_optimizer_state(os.fspath(filepath))
            return
        self._save_between_stages(checkpoint, self.broadcast(filepath), storage_options)

    def _save_between_stages(self, checkpoint: dict, filepath: _PATH, storage_options: Optional[Any]) -> None:
        """The folder ``save_checkpoint`` writes when no engine is live (see there), on every rank."""
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not supported for "
                f"`{type(self).__name__}` as `CheckpointIO` is not used."
            )
        module = self.lightning_module
        if module is None:
            return
        if self.zero_stage_3 and self._multi_device and self.is_global_zero:
            warning_cache.warn(  # stock's, word for word: the folder is the same
                "When saving the DeepSpeed Stage 3 checkpoint, "
                "each worker will save a shard of the checkpoint within a directory. "
                "If a single file is required after training, "
                "see https://lightning.ai/docs/pytorch/stable/advanced/model_parallel.html#"
                "deepspeed-zero-stage-3-single-file for instructions."
            )
        save_between_calls(
            module, checkpoint, os.fspath(filepath), world_size=self.world_size, rank_zero=self.is_global_zero,
            zero_stage=self._zero_stage, exclude_frozen=self.exclude_frozen_parameters,
            writers=self.call_series.writers(module),
            barrier=self.barrier, warn=rank_zero_warn,
        )

    @property
    def _zero_stage(self) -> int:
        self._init_config_if_needed()
        return int((self.config or {}).get("zero_optimization", {}).get("stage", 0)) or 3

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self.load_full_weights and self.zero_stage_3:
            return super().load_checkpoint(checkpoint_path, weights_only)  # one full-weights file, as stock
        _validate_checkpoint_directory(checkpoint_path)  # Lightning's FileNotFoundError, with its hints
        path = os.fspath(checkpoint_path)
        if self._fitting and not is_weights_only(path):
            assert self.lightning_module is not None
            return load_training_checkpoint(self.deepspeed_engine, path, strict=self.lightning_module.strict_loading)
        # DeepSpeed cannot load a checkpoint into an inference engine (its ZeRO-Offload optimizer has no
        # _restore_from_bit16_weights), nor one written between stages (no optimizer state in it): read the
        # fp32 weights ourselves and load them into the partitions.
        if self._fitting:
            rank_zero_warn(
                f"{path} was written between Trainer calls and holds weights but no optimizer state: "
                "the optimizer starts afresh from these weights"
            )
        return read_weights_checkpoint(path)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state_dict = checkpoint.get("state_dict")
        boundary = self.call_series.boundary
        if state_dict is None or boundary is None:
            return  # DeepSpeed's own load_checkpoint already put the weights (and masters) in the engine
        check_keys(self.lightning_module, state_dict, strict)
        boundary.checkpoint_loaded(state_dict, self.lightning_module, training=self._fitting)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return super().lightning_restore_optimizer  # False (DeepSpeed restores it), with stock's warning
