"""``StageSafeDeepSpeedStrategy``: Lightning's DeepSpeed strategy, safe to reuse a module across Trainer calls.

Thin glue: each override hands the work to :mod:`stagesafe.stages.boundary` (one call's passage) and to the
strategy's ``call_series``, a :class:`~stagesafe.stages.call_series.CallSeries` (what its calls share: the
handoff folder, its writer, the boundary of the call under way, how the last call ended). Its checkpoint hooks,
collectives and the waits for the handoff's write are bases of their own (:mod:`stagesafe.strategy_bases`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import logging
from collections.abc import Generator
from typing import Any, Mapping, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from typing_extensions import override

from stagesafe import _registration as registration
from stagesafe.handoff.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size
from stagesafe.stages import collectives
from stagesafe.stages.between_calls import given_back_optimizer, has_meta_tensors
from stagesafe.stages.boundary import StageBoundary, StageOptions
from stagesafe.stages.call_series import CallSeries
from stagesafe.stages.history import HandoffTarget, history_of
from stagesafe.stages.optimizer_resume import resume_optimizer
from stagesafe.strategy_arguments import (
    check_between_stages,
    check_keywords,
    check_local_handoff,
    check_optimizer_handoff,
    check_positional,
    check_zero_stage,
    checked_bool,
    checked_storage_options,
    checked_url,
    inference_config,
)
from stagesafe.strategy_bases.checkpoint_hooks import CheckpointHooks
from stagesafe.strategy_bases.guarded_collectives import GuardedCollectives
from stagesafe.strategy_bases.handoff_waits import HandoffWaits, StageReturned
from stagesafe.strategy_bases.process_groups_at_exit import end_process_groups_at_exit
from stagesafe.trainer_messages import (
    say_committed,
    say_optimizer_resumed,
    say_unchanged,
    say_versioned,
    warn_if_fit_has_nothing_left,
)
from stagesafe.upstream_warnings import quiet_per_step_warnings
from stagesafe.zero import engine as zero_engine

__all__ = ["StageSafeDeepSpeedStrategy"]

log = logging.getLogger(__name__)

_DEFAULT_HANDOFF_DIR = "stagesafe_handoff"


class StageSafeDeepSpeedStrategy(HandoffWaits, CheckpointHooks, GuardedCollectives):
    """DeepSpeed (ZeRO 1, 2 or 3) for any sequence of ``fit``/``validate``/``test``/``predict`` on one module.

    At the end of every Trainer call the weights are consolidated, the engine is destroyed and the module gets
    plain tensors back in its original dtype and device; the handoff (safetensors at ``handoff_uri``) is
    written when it does not hold those weights yet. Takes every argument of
    :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`, plus:

    Args:
        handoff_uri: fsspec URL of the handoff folder; default ``<default_root_dir>/stagesafe_handoff``.
        storage_options: passed to fsspec for ``handoff_uri`` and ``resume_from`` (credentials, endpoint, ...).
        max_shard_size: largest safetensors shard, e.g. ``"1GB"`` or a byte count. Smaller shards are hashed
            and written in parallel.
        resume_from: fsspec URL of a handoff (from an earlier job, any world size) whose weights a module
            takes before its first stage under stagesafe. If the handoff holds the optimizer state beside them
            (``stagesafe consolidate --optimizer``), the first ``fit`` that trains them continues it (moments and
            step counts, re-partitioned for this job's ranks); else the optimizer starts afresh, as the log says.
        between_stages: ``"cpu"`` (default): after each stage the module holds real tensors. ``"meta"``: it
            holds meta tensors (no host memory); the next stage's engine is built from the handoff one
            submodule at a time, and a trained stage's weights are gathered and written one tensor at a time
            (ZeRO-3 only). ``stagesafe.restore(module, uri)`` materialises the module on demand.
        wait_for_write: ``False`` (default): a Trainer call returns as soon as the module holds its weights;
            the handoff is written in the background (each rank writes its share of the shards, from private
            copies) and joined by the next stage, by :meth:`wait_for_handoff`, or at interpreter exit (which
            then fails the process if the write fails). ``True``: each call returns once its handoff is
            committed.
        keep_optimizer_state: ``True`` (default): at the end of ``fit`` each rank keeps its partition of the
            optimizer state (moments, step counts, loss scaler) and the lr schedulers' states in host memory,
            so that ``trainer.save_checkpoint(path)`` between calls writes what DeepSpeed writes during a stage
            and ``fit(ckpt_path=path)`` continues exactly (8 bytes per parameter over the ranks with AdamW: its
            fp32 masters are the module's own values). The next ``fit`` lets it go as it starts. ``False`` saves
            that host memory; such a checkpoint then holds weights only, and ``save_checkpoint`` warns.
        handoff_optimizer_state: ``False`` (default). ``True``: the handoff written at the end of a ``fit`` that
            trained also holds the optimizer state, per parameter, in the form ``stagesafe consolidate
            --optimizer`` writes (fp32 moments keyed by parameter name, step counts and hyperparameters as JSON,
            in ``<handoff>/optimizer-<tag>``, bound by the weights' manifest): a job of any number of ranks
            continues it with ``resume_from=<handoff>``. Written while the engine lives, before the weights, one
            shard at a time on rank 0 (8 bytes per parameter with AdamW). Not with ``between_stages="meta"``.
        overwrite_handoff: ``False`` (default): a committed handoff of another run at ``handoff_uri`` is never
            replaced: a ``handoff_uri`` you named is refused at the first call with
            :class:`~stagesafe.HandoffExistsError`, the default folder gives way to ``stagesafe_handoff-v1``,
            ``-v2``, ... ``True`` replaces it.
        check_host_memory: ``True`` (default): before the first step of ``fit`` every rank asks its host for
            the memory the end of the stage adds (the ranks of a host together, within ``MemAvailable`` and any
            cgroup limit), and on a shortfall every rank raises :class:`~stagesafe.HostMemoryError` naming the
            bytes and the ways out, instead of being killed by the kernel later. ``False`` skips the check.
    """

    strategy_name = "stagesafe_deepspeed"

    def __init__(
        self,
        *args: Any,
        handoff_uri: Optional[str] = None,
        storage_options: Optional[Mapping[str, Any]] = None,
        max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
        resume_from: Optional[str] = None,
        between_stages: str = "cpu",
        wait_for_write: bool = False,
        keep_optimizer_state: bool = True,
        check_host_memory: bool = True,
        handoff_optimizer_state: bool = False,
        overwrite_handoff: bool = False,
        config: Optional[Union[_PATH, dict[str, Any]]] = None,
        **kwargs: Any,
    ) -> None:
        known = {*inspect.signature(StageSafeDeepSpeedStrategy.__init__).parameters}
        stock = [name for name in inspect.signature(DeepSpeedStrategy.__init__).parameters if name != "self"]
        check_keywords(kwargs, known | {*stock}, owner=type(self).__name__)
        check_positional(args, stock, owner=type(self).__name__, accelerator=Accelerator)
        check_zero_stage(kwargs.get("stage", 2))
        # Lightning writes into the config it is given; a copy keeps the caller's dict reusable.
        super().__init__(*args, config=copy.deepcopy(config), **kwargs)
        self.storage_options = checked_storage_options(storage_options)
        self.handoff_uri = checked_url("handoff_uri", handoff_uri, self.storage_options)
        self.resume_from = checked_url("resume_from", resume_from, self.storage_options)
        if self.resume_from is not None and not collectives.is_up():
            # With a process group up (a job that runs several Trainers), every rank looks at the stage together,
            # so that no rank fails alone while the others wait for it; before it, a rank that fails ends the job
            # through its launcher.
            check_local_handoff("resume_from", self.resume_from, self.storage_options)
        self.max_shard_size = max_shard_size  # as given (LightningCLI reads it back); the stages get the bytes
        self._shard_bytes = parse_size(max_shard_size)
        config_known = isinstance(self.config, dict)  # a config file is read later
        if config_known and isinstance(self.config.get("zero_optimization"), dict):
            stage = self.config["zero_optimization"].get("stage", 0)
            check_zero_stage(stage, where="config['zero_optimization']['stage']")
        check_between_stages(between_stages, zero_stage_3=bool(self.zero_stage_3) if config_known else None)
        self.between_stages = between_stages
        self.wait_for_write = checked_bool("wait_for_write", wait_for_write)
        self.keep_optimizer_state = checked_bool("keep_optimizer_state", keep_optimizer_state)
        self.check_host_memory = checked_bool("check_host_memory", check_host_memory)
        self.handoff_optimizer_state = checked_bool("handoff_optimizer_state", handoff_optimizer_state)
        check_optimizer_handoff(self.handoff_optimizer_state, between_stages=between_stages)
        checked_bool("exclude_frozen_parameters", self.exclude_frozen_parameters)  # Lightning's; the handoff honours it
        self.overwrite_handoff = checked_bool("overwrite_handoff", overwrite_handoff)
        self.call_series = CallSeries(storage_options=self.storage_options, resume_from=self.resume_from,
                                  overwrite=self.overwrite_handoff)
        self._fresh: set[int] = set()  # ids of the parameters zero.Init built in this call's configure_model
        self._stepped = False  # an optimizer step was made in this call

    # -- entering a stage -------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        """Lightning's; first, a ``resume_from`` the module will take is looked at on every rank, before
        DeepSpeed starts its process group: a handoff that is not there fails here, in one line per rank. The
        upstream warnings printed at every step are filtered here, on every rank
        (:mod:`~stagesafe.upstream_warnings`)."""
        quiet_per_step_warnings()
        module = self.lightning_module
        fresh = module is not None and history_of(module) is None
        if self.resume_from is not None and fresh and not collectives.is_up():
            from stagesafe.handoff.read import read_manifest

            read_manifest(self.resume_from, storage_options=self.storage_options or None)
        super().setup_environment()

    @override
    def _init_deepspeed_distributed(self) -> None:
        """Lightning's; the process groups DeepSpeed starts here are ended as the interpreter exits
        (:mod:`~stagesafe.strategy_bases.process_groups_at_exit`). A group that was up before is its owner's."""
        started_here = not collectives.is_up()
        super()._init_deepspeed_distributed()
        if started_here:
            end_process_groups_at_exit()

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Lightning's, which builds ``configure_model``'s layers under ``zero.Init``, noting which parameters
        were built there: partitioned by design, not left over from an earlier engine."""
        module = self.lightning_module
        before = {id(p) for p in module.parameters()} if module is not None else set()
        with super().model_sharded_context():
            yield
        if module is not None:
            self._fresh = {id(p) for p in module.parameters() if id(p) not in before and zero_engine.is_zero3_param(p)}

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        module = self.lightning_module
        assert module is not None
        target = self._handoff_target(trainer)
        writer = self.call_series.writer_for(target, module, world_size=self.world_size, timeout=self._wait_seconds,
                                         meta=self.between_stages == "meta", on_commit=say_committed)
        self.call_series.calls += 1
        writer.check(f"entering {trainer.state.fn.value}")  # a failed background write is raised here, on every rank
        # A fit with nothing left to train changes nothing: its boundary is that of a stage that does not train.
        trains = trainer.state.fn == TrainerFn.FITTING and not warn_if_fit_has_nothing_left(trainer)
        self._stepped = False
        boundary = StageBoundary(module, target, self._stage_options(trainer, trains=trains), writer=writer)
        self._fresh = set()
        resume = None
        if self.resume_from is not None:
            resume = HandoffTarget(uri=self.resume_from, storage_options=self.storage_options)
        boundary.enter(resume_from=resume, weights_from=self._weights_from(trainer))  # refuses a stale module first
        self.call_series.boundary = boundary
        if not any(isinstance(cb, StageReturned) for cb in trainer.callbacks):
            trainer.callbacks.append(StageReturned())
        if boundary.options.fresh:  # the boundary holds the fp32 values: they become the masters
            zero_engine.cast_beside_zero_init(module, self._compute_dtype())
        with zero_engine.flat_broadcasts():  # DeepSpeed's broadcast of each parameter: one per bucket instead
            super().setup(trainer)
        boundary.engine_built(self.model, training=trains)
        if trains and boundary.resumed is not None:  # the module holds resume_from's weights: its optimizer too
            say_optimizer_resumed(boundary.resumed.uri, resume_optimizer(self.model, boundary.resumed))

    def _stage_options(self, trainer: "pl.Trainer", *, trains: bool) -> StageOptions:
        """How this call's boundary runs: this strategy's arguments, the call's kind and device; ``trains``:
        the call may change the weights (a ``fit`` that has steps left)."""
        meta = self.between_stages == "meta"
        return StageOptions(
            trainer.state.fn.value,
            meta=meta,
            materialize=self._partition_from_handoff if meta else None,
            max_shard_size=self._shard_bytes,
            training=trains,
            device=self.root_device,
            fresh=frozenset(self._fresh),
            keep_optimizer_state=self.keep_optimizer_state,
            exclude_frozen=self.exclude_frozen_parameters,
            check_host_memory=self.check_host_memory,
            handoff_optimizer_state=self.handoff_optimizer_state,
        )

    def _partition_from_handoff(self, values: Mapping[str, Any]) -> None:
        """Build ZeRO-3 partitions for a meta module from the handoff, in the dtype the engine computes in."""
        zero_engine.partition_from_values(
            self.lightning_module, values, config=self.config, dtype=self._compute_dtype(), device=self.root_device
        )

    def _compute_dtype(self) -> torch.dtype:
        """The dtype the engine computes in, as its config says."""
        self._init_config_if_needed()
        assert isinstance(self.config, dict)
        enabled = {key for key in ("bf16", "fp16") if self.config.get(key, {}).get("enabled")}
        return torch.bfloat16 if "bf16" in enabled else torch.float16 if "fp16" in enabled else torch.float32

    def _handoff_target(self, trainer: "pl.Trainer") -> HandoffTarget:
        """The folder this run writes: claimed once (:mod:`~stagesafe.stages.ownership`), every rank together."""
        asked = self.handoff_uri
        if asked is None:
            asked = str(trainer.default_root_dir).rstrip("/") + "/" + _DEFAULT_HANDOFF_DIR
        return self.call_series.target(asked, named=self.handoff_uri is not None, on_versioned=say_versioned)

    def _weights_from(self, trainer: "pl.Trainer", *, failed: bool = False) -> dict[str, Any]:
        """The stage and step that a stage's new weights come from, for the handoff's metadata; ``failed``: the
        call raised (a fit's weights are then those of its last step, not of a fit run to its end)."""
        return {
            "stage": trainer.state.fn.value,
            "global_step": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "world_size": int(self.world_size),
            "zero_stage": int((self.config or {}).get("zero_optimization", {}).get("stage", 0)),
            "call_failed": failed,
        }

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        """Lightning's version, minus three faults: it read ``zero_allow_untested_optimizer`` unguarded,
        and it wiped every module hook (the user's too) to get rid of an earlier engine's, which
        the strategy now removes by handle at the end of each stage."""
        import deepspeed

        assert isinstance(self.config, dict)
        engine, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.root_device.index),
            config=inference_config(self.config, zero_stage_3=self.zero_stage_3),
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
        self.model = engine

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Any, model: Optional[Union["pl.LightningModule", Module]] = None, **kwargs: Any
    ) -> Any:
        """Lightning's; after the first real step the boundary sizes the optimizer state it keeps at the end."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._stepped = True
        boundary = self.call_series.boundary
        if boundary is not None and self._engine_is_live:
            boundary.optimizer_stepped(self.model)
        return result

    @override
    def on_validation_start(self) -> None:
        self._loop_started()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._loop_started()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._loop_started()
        super().on_predict_start()

    def _loop_started(self) -> None:
        """After Lightning restored any ``ckpt_path``: an inference stage's weights may be written now."""
        boundary = self.call_series.boundary
        if boundary is not None:
            boundary.loop_started()

    # -- leaving a stage --------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        boundary, self.call_series.boundary = self.call_series.boundary, None
        try:
            if boundary is not None:
                self._leave(boundary)
        finally:
            if self.lightning_module is not None and has_meta_tensors(self.lightning_module):
                self._teardown_without_moving_the_module()
            else:
                super().teardown()
            if boundary is not None:
                boundary.place_meta()

    def _leave(self, boundary: StageBoundary) -> None:
        engine = self.model if self._engine_is_live else None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        failed = trainer is None or trainer.state.status != TrainerStatus.RUNNING
        ending = self.call_series.call_ended(failed=failed)
        # A fit that made no step (max_epochs already reached) trained nothing; one given a ckpt_path may have
        # loaded new weights into the engine (DeepSpeed's own load) even so.
        fitted = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        trained = fitted and (self._stepped or trainer.ckpt_path is not None)
        layout = zero_engine.optimizer_layout(engine) if fitted and engine is not None else None  # before destroy
        failed_anywhere = failed or bool(ending.failed) or ending.broken
        try:
            self.call_series.last_report = boundary.exit(
                engine,
                trained=trained,
                weights_from=self._weights_from(trainer, failed=failed_anywhere) if trainer is not None else {},
                gather=ending.gather,
                background=not failed,
                lr_schedulers=[config.scheduler.state_dict() for config in self.lr_scheduler_configs],
                failed=failed_anywhere,
                state_places=layout.places if layout is not None else None,
            )
        except Exception as exc:
            if not failed:
                raise
            # The stage already failed: that error is the one to raise, not this consequence of it.
            log.error("stagesafe: after the stage failed, its boundary failed too: %s", exc, exc_info=exc)
            self.call_series.last_report = boundary.report
        else:
            if fitted and not trained and not failed and not boundary.report.wrote:
                say_unchanged(boundary.report.uri)
        finally:
            self.model = boundary.module
            self._give_back_optimizers(fitted, layout)

    @property
    def _wait_seconds(self) -> float:
        """How long stagesafe waits for another rank or thread: the strategy's ``timeout``, as its collectives."""
        return (self._timeout or default_pg_timeout).total_seconds()

    def _give_back_optimizers(self, fitted: bool, layout: Optional[zero_engine.OptimizerLayout]) -> None:
        """After a fit, as stock keeps them: ``trainer.optimizers`` the user's optimizer over the module's
        parameters, the lr as the fit left it (its state views into the kept one at one rank), and
        ``trainer.lr_scheduler_configs`` the schedulers at their step; nothing of the engine. Another call
        leaves them as the last fit did (Lightning sets them up only for a fit)."""
        if not fitted:
            return
        self.optimizers = (
            [given_back_optimizer(self.lightning_module, layout, timeout=self._wait_seconds)]
            if layout is not None else []
        )
        if layout is None:
            self.lr_scheduler_configs = []

    def _teardown_without_moving_the_module(self) -> None:
        """Lightning's teardown moves the module with ``.cpu()``, which a module of meta tensors refuses; the
        handoff's own error is the one to raise, so the module is left where it is."""
        module, self._lightning_module = self._lightning_module, None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:  # type: ignore[override]
        registration.register(strategy_registry, cls)

StageSafeDeepSpeedStrategy.register_strategies(StrategyRegistry)
registration.stop_observing()
