"""One Trainer call's passage through a DeepSpeed engine: enter, engine built, exit.

Knows nothing of Lightning. ``enter`` refuses a module with stale DeepSpeed state; ``engine_built`` loads the
exact fp32 values into the engine's masters (the kept fp32 masters where the module holds 16 bits); ``exit``
takes the weights the stage ends with (the fp32 masters after training), keeps what the engine held beyond
them (:class:`~stagesafe.stages.history.KeptTraining`: masters of 16-bit parameters, the optimizer's
partition), destroys the engine, gives the module back plain tensors in the dtype and device it had before its
first stage, and has the handoff (fp32 wherever training had masters) written when it does not hold them yet
(by the strategy's :class:`~stagesafe.stages.writer.HandoffWriter`, in the background unless asked otherwise).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stagesafe.errors import HandoffCorruptError, HandoffNotFoundError, StaleDeepSpeedStateError
from stagesafe.handoff.plan import plan_handoff
from stagesafe.handoff.read import HandoffReader, check_present
from stagesafe.handoff.save import save_state_dict, save_streamed
from stagesafe.stages import collectives
from stagesafe.stages.history import (
    HandoffTarget,
    KeptTraining,
    ModuleHistory,
    fingerprint,
    history_of,
    new_history,
    state_tensors,
)
from stagesafe.stages.host import HostBuffers, HostPool
from stagesafe.stages.shared_write import names_written_by
from stagesafe.stages.writer import HandoffWriter, WriteRequest
from stagesafe.restore import assign_values, load_for
from stagesafe.zero import engine as zero_engine

__all__ = ["BoundaryReport", "StageBoundary", "assert_clean"]

log = logging.getLogger(__name__)


@dataclass
class BoundaryReport:
    """What one stage boundary did, for logs and the demo."""

    stage: str
    uri: str
    seconds: float = 0.0  # leaving the stage: consolidate, destroy, restore, start the write
    enter_seconds: float = 0.0  # entering it: the clean check, host memory, the engine's partitions from a handoff
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step (the writer's too, once it ran)
    wrote: bool = False  # a handoff write of this stage's weights was started
    handoff_bytes: int = 0
    stale_problems: list[str] = field(default_factory=list)
    copied_while_waiting: int = 0  # bytes cloned for the background writer before the call could return

    @property
    def clean(self) -> bool:
        return not self.stale_problems


def assert_clean(module: nn.Module, *, fresh: set[int] = frozenset()) -> None:
    """Raise :class:`StaleDeepSpeedStateError` when the module still carries an earlier engine's state.
    ``fresh``: ids of parameters DeepSpeed's ``zero.Init`` built in this call (Lightning's ``configure_model``)."""
    problems = zero_engine.find_stale_state(module, fresh=fresh)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise StaleDeepSpeedStateError(
            f"The module still carries state of an earlier DeepSpeed engine: {shown}. Building a new engine over it "
            "would re-adopt stale ZeRO partitions. Run every stage through StageSafeDeepSpeedStrategy, or load the "
            "weights into a fresh module with stagesafe.restore(module, handoff_uri)."
        )


class StageBoundary:
    """The life of one Trainer call's engine over ``module``; create one per call."""

    def __init__(
        self,
        module: nn.Module,
        target: HandoffTarget,
        stage: str,
        *,
        writer: HandoffWriter,
        meta: bool = False,
        materialize: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        training: bool = False,
        device: torch.device | None = None,
        fresh: set[int] = frozenset(),
        keep_optimizer_state: bool = True,
        exclude_frozen: bool = False,
    ) -> None:
        """``meta``: between stages the module holds meta tensors; ``materialize(values)`` then builds the next
        engine's partitions from the handoff, read one shard at a time. ``training``: the stage trains on
        ``device``, so host memory for its end is prepared while it runs. ``fresh``: ids of the parameters
        (whose values only the engine has) and floating buffers ``zero.Init`` built in this call.
        ``keep_optimizer_state``: a training stage's end keeps this rank's files of DeepSpeed's checkpoint
        (``exclude_frozen``: without frozen parameters, as ``save_checkpoint`` would)."""
        self.module = module
        self.target = target
        self.stage = stage
        self.writer = writer
        self.meta = meta
        self.training = training
        self.device = device
        self._fresh = set(fresh)
        self._keep_optimizer_state = keep_optimizer_state
        self._exclude_frozen = exclude_frozen
        self._masters: dict[str, torch.Tensor] = {}  # kept fp32 masters of the 16-bit tensors the stage starts with
        self._fresh_names: set[str] = set()
        self._materialize = materialize
        self._host: HostBuffers | None = None
        self._kept_host: HostPool | None = None  # where the end copies the engine's optimizer state
        self._stepped = False  # the optimizer state was sized after the first step
        self._written_here: set[str] | None = None
        self._meta_values: dict[str, torch.Tensor] | None = None
        self._footprint: zero_engine.ModuleFootprint | None = None
        self._entry: Mapping[str, torch.Tensor] | None = None
        self._loaded: dict[str, torch.Tensor] | None = None
        self.history: ModuleHistory | None = None
        self.report = BoundaryReport(stage=stage, uri=target.uri)

    # -- entering -------------------------------------------------------------------------------------------
    def enter(self, *, resume_from: HandoffTarget | None = None) -> None:
        """Check the module is clean; note what it holds.

        ``resume_from``: a handoff (perhaps written by another job, at another world size) whose weights the
        module takes before its first stage under stagesafe; ignored for a module that has been through one.
        A module on the meta device (meta mode) is not loaded: its engine is built from that handoff.
        """
        start = time.perf_counter()
        assert_clean(self.module, fresh=self._fresh)
        history = history_of(self.module)
        _join_elsewhere(history, self.writer)
        self.writer.wait_device()  # the last stage's host memory is unlocked before it is locked again
        tensors = state_tensors(self.module)
        params = dict(self.module.named_parameters(remove_duplicate=False))
        self._fresh_names = {n for n, p in params.items() if id(p) in self._fresh and hasattr(p, "ds_id")}
        on_meta = any(t.device.type == "meta" for t in tensors.values())
        if on_meta and self._materialize is None:
            raise ValueError(
                "the module holds meta tensors: load weights first (stagesafe.restore(module, uri)), or run the "
                "stage with StageSafeDeepSpeedStrategy(between_stages='meta')"
            )
        if history is None and resume_from is not None and not on_meta:
            tensors = self._resume(resume_from)
        if history is None:
            history = new_history(self.module)
            if resume_from is not None:
                history.target = resume_from if on_meta else None
                history.weights_from = {"resumed_from": resume_from.uri}
        history.note_names(tensors, fresh=self._fresh_names)
        self.history = history
        self._still_there(history, on_meta)
        self._footprint = zero_engine.take_footprint(self.module, fresh=self._fresh)
        self._entry = {n: t for n, t in tensors.items() if n not in self._fresh_names}
        if history.kept is not None and not on_meta:
            self._masters = history.kept.masters_for(self._entry)
        if self.training and not on_meta and not self.meta:
            self._host = self._prepare_host(tensors)
        if not self.training and not on_meta and not self._fresh_names and not history.holds(self.target, tensors):
            # An inference stage ends with the weights it started with: write them while it runs, from the
            # tensors this boundary keeps (the engine computes on copies of its own); its end joins the write.
            self._join_last_write()
            entry = {n: t.to("cpu") for n, t in {**self._entry, **self._masters}.items()}
            self._start_write(history, entry, tensors, gathered=None, host=None, background=False)
        if on_meta:  # feed the engine from the handoff one shard, one submodule at a time
            source = history.target
            if source is None:
                raise ValueError(
                    "the module holds meta tensors and no handoff holds its weights: pass resume_from=URI, or load "
                    "them with stagesafe.restore(module, uri) first"
                )
            if self.writer.pending_uri == source.uri:
                self.writer.join()  # this stage reads the handoff: its write must be committed
            reader = HandoffReader(source.uri, storage_options=source.storage_options)
            materialize = self._materialize
            collectives.all_ranks(lambda: materialize(reader), f"building the engine's partitions from {source.uri}")
            self._entry = reader
        self.report.enter_seconds = time.perf_counter() - start

    def _still_there(self, history: ModuleHistory, on_meta: bool) -> None:
        """The handoff that holds the module's weights may have been deleted or damaged since it was written
        (rank 0 looks; every rank acts on what it saw). A module with weights writes it again at this stage;
        a module of meta tensors has nothing to write it from: its error is raised, naming the handoff."""
        source = history.target
        if source is None or history.fingerprint is None or self.writer.pending_uri == source.uri:
            return
        if source != self.target and not on_meta:
            return  # the module's weights go to this stage's handoff in any case
        absent = collectives.on_rank_zero(lambda: _absence(source), f"looking at the handoff {source.uri}")
        if absent is None:
            return
        missing, error = absent
        if on_meta:
            raise (HandoffNotFoundError if missing else HandoffCorruptError)(
                f"the module holds meta tensors, and the handoff that holds its weights is gone or damaged: {error}. "
                "Nothing can rebuild them here: resume from another copy (resume_from=URI on a fresh module)"
            )
        log.warning("stagesafe: %s; this stage writes the module's weights there again", error)
        history.lost()

    def _resume(self, source: HandoffTarget) -> dict[str, torch.Tensor]:
        """Every rank loads and checks the handoff; none changes its module unless all can."""
        placed = collectives.all_ranks(
            lambda: load_for(self.module, source.uri, storage_options=source.storage_options,
                             progress=None if collectives.rank() == 0 else False),  # one bar, on rank 0's terminal
            f"reading the handoff to resume from at {source.uri} (every rank reads it: a node-local path is "
            "not visible from other nodes; use shared storage or an object store)",
        )
        zero_engine.strip_deepspeed_state(self.module, None)
        assign_values(self.module, placed)
        return state_tensors(self.module)

    def engine_built(self, engine: Any, *, training: bool) -> None:
        """Give the new engine's optimizer the exact fp32 values instead of ones rebuilt from 16-bit weights;
        start making host memory ready for the optimizer state the stage's end keeps, as far as it is known."""
        if training and self._entry is not None:
            entry = {**self._entry, **self._masters} if self._masters else self._entry  # a handoff reader stays lazy
            collectives.all_ranks(lambda: zero_engine.set_fp32_masters(self.module, entry), "loading the fp32 master weights")
        if self._sizes_kept_state():
            def specs() -> list[tuple[torch.Size, torch.dtype]]:
                now = zero_engine.checkpoint_device_specs(engine, exclude_frozen=self._exclude_frozen) or []
                return [*now, *zero_engine.foreseen_state_specs(engine)]

            self._size_kept_state(specs)

    def optimizer_stepped(self, engine: Any) -> None:
        """After an optimizer step (local, cheap once done): the first time the engine has stepped, the state
        the optimizer made is sized, and host memory for what was not foreseen is made ready too."""
        if self._stepped or not self._sizes_kept_state() or getattr(engine, "global_steps", 0) < 1:
            return
        self._stepped = True
        self._size_kept_state(lambda: zero_engine.checkpoint_device_specs(engine, exclude_frozen=self._exclude_frozen) or [])

    def _sizes_kept_state(self) -> bool:
        return (self.training and self._keep_optimizer_state and self.device is not None
                and self.device.type == "cuda")

    def _size_kept_state(self, specs_now: Callable[[], list[tuple[torch.Size, torch.dtype]]]) -> None:
        try:
            specs = specs_now()
        except Exception as exc:  # noqa: BLE001 - only the end's speed is at stake: it allocates then
            log.warning("stagesafe: could not size the optimizer state kept at the end of %s: %s", self.stage, exc)
            return
        if self._kept_host is None and specs:
            self._kept_host = HostPool(specs, lock_on=self.device)
        elif self._kept_host is not None:
            self._kept_host.add(specs)

    def checkpoint_loaded(self, values: Mapping[str, torch.Tensor], engine_module: nn.Module, *, training: bool) -> None:
        """A checkpoint's full weights were loaded during the stage: put them in the engine, keep them for exit."""
        zero_engine.load_values_into_engine(engine_module, values, set_masters=training)
        self._loaded = dict(values)

    # -- leaving ----------------------------------------------------------------------------------------------
    def exit(
        self,
        engine: Any | None,
        *,
        trained: bool,
        weights_from: Mapping[str, Any],
        gather: bool,
        background: bool,
        lr_schedulers: Sequence[Mapping[str, Any]] = (),
    ) -> BoundaryReport:
        """Take the stage's weights, keep what the engine held beyond them, destroy the engine, restore the
        module, and have the handoff written.

        ``gather``: every rank is here (the stage ended, or failed, on all of them), so weights may be gathered
        from the engine; without it a rank keeps the weights the stage started with. ``background``: the
        write may outlast the call (joined by the next stage, ``wait_for_handoff()`` or the exit).
        ``weights_from``: stage and step that new weights come from, for the handoff's metadata.
        ``lr_schedulers``: the trainer's lr scheduler states, kept beside the optimizer's.
        """
        start = time.perf_counter()
        mark = _PhaseClock(self.report.phases)
        history = self.history
        assert history is not None, "exit() without enter()"
        failure: BaseException | None = None  # raised at the end, once the module is clean again
        try:
            self._join_last_write()  # one write at a time; a failure of it is raised once this stage is safe
        except BaseException as exc:  # noqa: BLE001
            failure = exc
        mark("join_last_write")
        host = self._host.ready() if self._host is not None else None
        mark("host_memory_ready")
        meta_specs = zero_engine.full_specs(self.module)[0] if self.meta else {}  # shapes, before the engine goes
        values: dict[str, torch.Tensor] | None = None
        gathered: zero_engine.GatheredValues | None = None
        streamed = write_failed = False
        if engine is not None and trained and gather and self.meta:
            try:
                self._write_streamed(history, {**weights_from, **self._metadata(history)})
                history.weights_from, streamed = dict(weights_from), True
            except BaseException as exc:  # noqa: BLE001 - nothing may be lost: the weights stay in memory
                failure, self.meta, write_failed = failure or exc, False, True
        try:
            if not streamed and engine is not None and gather and (trained or self._fresh_names):
                values, gathered = collectives.all_ranks(
                    lambda: self._consolidate(history, host, trained), "consolidating the ZeRO shards"
                )
                if trained:
                    history.weights_from = dict(weights_from)
            elif not streamed and self._loaded is not None:
                values = {
                    n: v.detach().to("cpu", history.original[n][0])
                    for n, v in self._loaded.items()
                    if n in history.original
                }
                history.weights_from = dict(weights_from)
        except BaseException as exc:  # noqa: BLE001 - the module falls back to the weights it started with
            failure, values, gathered = failure or exc, None, None
        mark("consolidate")
        new_weights = engine is not None and trained and gather and (streamed or values is not None)
        if new_weights and self._kept_host is not None:
            self._kept_host.ready()
        mark("kept_host_memory_ready")
        checkpoint, missing = self._engine_checkpoint(engine) if new_weights else (None, "")
        kept_host, self._kept_host = self._kept_host, None
        mark("keep_engine_state")
        if engine is not None:
            zero_engine.destroy_engine(engine)
        zero_engine.strip_deepspeed_state(self.module, self._footprint)
        mark("destroy")
        masters = self._masters
        if values is None and not streamed and (not self.meta or not self._in_handoff(history)):
            values = self._entry_values(history)  # unchanged; a meta module's weights must be in a handoff first
        elif values is not None:
            masters = {n: v for n, v in values.items() if v.dtype != history.original[n][0]}  # fp32, 16-bit module
        if values is not None:
            self._restore(values, history)
            values = {**values, **{n: m for n, m in masters.items() if n in values}}  # the handoff's: fp32 masters
        restored = state_tensors(self.module)
        if new_weights:
            history.kept = KeptTraining(
                fingerprint(restored), masters={} if self.meta else masters, checkpoint=checkpoint,
                lr_schedulers=[copy.deepcopy(dict(s)) for s in lr_schedulers], world_size=collectives.world_size(),
                missing=missing,
            )
        if kept_host is not None:  # its taken tensors hold the kept checkpoint: locked while it lives
            kept_host.close(history.kept if checkpoint is not None else None)
        if write_failed:
            history.lost()  # the next stage writes the handoff
            if host is not None:
                host.unlock()
        elif values is not None and not history.holds(self.target, restored):
            write_failure = self._publish(
                history, values, restored, gathered, host, gather=gather, background=background and not self.meta
            )
            failure = failure or write_failure
        elif host is not None:
            host.unlock()
        mark("publish")
        if self.meta and failure is None:  # placed by place_meta(), once Lightning's teardown moved the module
            self._meta_values = {
                name: torch.empty(shape, dtype=history.original[name][0], device="meta")
                for name, (shape, _) in meta_specs.items()
                if name in history.original
            }
        self.report.stale_problems = zero_engine.find_stale_state(self.module)
        self.report.seconds = time.perf_counter() - start
        self._entry = self._loaded = None
        if failure is not None:
            raise failure
        return self.report

    def place_meta(self) -> None:
        """Meta mode, after Lightning's teardown (which moves the module with ``.cpu()``): the module's tensors
        become meta tensors, holding no memory until the next stage reads the handoff."""
        values, self._meta_values = self._meta_values, None
        if values is None:
            return
        before = fingerprint(state_tensors(self.module))
        assign_values(self.module, values)
        assert self.history is not None
        if self.history.kept is not None:
            self.history.kept.moved(before, state_tensors(self.module))
        if self.report.wrote or self.history.target is None:
            self.history.target = self.target
        self.history.fingerprint = fingerprint(state_tensors(self.module))
        self.report.stale_problems = zero_engine.find_stale_state(self.module)

    # -- the parts of exit ------------------------------------------------------------------------------------
    def _join_last_write(self) -> None:
        """One write at a time: the last one (any strategy's) ends before this stage's starts."""
        _join_elsewhere(self.history, self.writer)
        if self.writer.pending:
            self.writer.join()

    def _engine_checkpoint(self, engine: Any) -> tuple[dict[str, dict[str, Any]] | None, str]:
        """This rank's files of DeepSpeed's checkpoint at the stage's end, or None and why there are none."""
        if not self._keep_optimizer_state:
            return None, "StageSafeDeepSpeedStrategy(keep_optimizer_state=False) keeps none between Trainer calls"
        try:
            pool = self._kept_host
            files = zero_engine.checkpoint_files(
                engine, exclude_frozen=self._exclude_frozen, host_memory=pool.take if pool is not None else None
            )
        except Exception as exc:  # noqa: BLE001 - the weights are what must not be lost; this is said at saving
            log.warning("stagesafe: could not keep the optimizer state at the end of %s: %s", self.stage, exc)
            return None, f"keeping it at the end of {self.stage} failed ({type(exc).__name__}: {exc})"
        if files is None:
            return None, "DeepSpeed holds part of it outside its checkpoint files here (NVMe offload or MoE layers)"
        return files, ""

    def _in_handoff(self, history: ModuleHistory) -> bool:
        return history.target == self.target and history.fingerprint is not None

    def _publish(
        self,
        history: ModuleHistory,
        values: Mapping[str, torch.Tensor],
        restored: Mapping[str, torch.Tensor],
        gathered: zero_engine.GatheredValues | None,
        host: HostBuffers | None,
        *,
        gather: bool,
        background: bool,
    ) -> BaseException | None:
        """Have the handoff written (returns a failure to raise). With every rank here, the writer writes it,
        in the background or not; otherwise rank 0 writes it alone, now (``wait_for_handoff()`` on the other
        ranks waits for it), and every rank forgets whether the handoff holds the weights, so that the next
        stage, in step again, writes it once more."""
        if not gather:
            self.report.wrote = True
            if host is not None:
                host.unlock()
            history.lost()
            target, metadata = self.target, self._metadata(history)
            self.writer.write_alone(
                lambda: save_state_dict(values, target.uri, max_shard_size=target.max_shard_size, overwrite=True,
                                        metadata=metadata, storage_options=target.storage_options),
                target.uri,
            )
            return None
        self._start_write(history, values, restored, gathered=gathered, host=host, background=background)
        if background:
            return None
        try:
            self.writer.join()
        except BaseException as exc:  # noqa: BLE001 - the module keeps the new weights; then we raise
            return exc
        return None

    def _start_write(
        self,
        history: ModuleHistory,
        values: Mapping[str, torch.Tensor],
        tensors: Mapping[str, torch.Tensor],
        *,
        gathered: zero_engine.GatheredValues | None,
        host: HostBuffers | None,
        background: bool,
    ) -> None:
        """Start the writer on ``values``, which the module's ``tensors`` hold. A write that may outlast the
        call (``background``) reads private copies of the shards this rank writes."""
        self.report.wrote = True
        self.report.handoff_bytes = sum({id(v): v.nbytes for v in values.values()}.values())
        private, fill = self._private_copies(values, gathered) if background else (values, None)
        request = WriteRequest(
            values=private,
            uri=self.target.uri,
            storage_options=self.target.storage_options,
            max_shard_size=self.target.max_shard_size,
            metadata=self._metadata(history),
            fill=fill,
            unlock=host.unlock if host is not None else None,
            phases=self.report.phases,
            on_failed=history.lost,
        )
        history.written(self.target, tensors, self.writer)
        self.writer.start(request)

    def _metadata(self, history: ModuleHistory) -> dict[str, Any]:
        """The handoff's metadata: where its weights come from, and the module's original dtypes."""
        dtypes = {n: str(dtype).removeprefix("torch.") for n, (dtype, _) in history.original.items()}
        return {**history.weights_from, "original_dtypes": dtypes}

    def _entry_values(self, history: ModuleHistory) -> dict[str, torch.Tensor] | None:
        """The weights the stage started with (a stage that changed none, or failed on another rank)."""
        entry = self._entry
        if entry is None or isinstance(entry, HandoffReader):
            return None
        missing = [n for n in history.original if n not in entry]
        if missing:  # built by zero.Init in this call, and the engine could not be asked for them
            log.error(
                "stagesafe: the stage failed before the weights of %s (built by zero.Init) could be gathered; "
                "those parameters stay DeepSpeed placeholders and the next stage refuses the module",
                missing[:3],
            )
            return None
        return {n: entry[n] for n in history.original}

    def _write_streamed(self, history: ModuleHistory, metadata: Mapping[str, Any]) -> None:
        """Gather and write one tensor at a time (rank 0 writes, every rank joins each gather), so host memory
        stays near one tensor; used when the module lives on the meta device between stages."""
        specs, aliases = zero_engine.full_specs(self.module)
        masters = self._master_names(history)
        specs = {
            n: {"dtype": "float32" if n in masters else str(history.original[n][0]).removeprefix("torch."),
                "shape": list(shape)}
            for n, (shape, _) in specs.items()
            if n in history.original
        }
        gathered = zero_engine.GatheredValues(self.module, self._to_handoff(history, masters))
        order = [n for n in specs if n not in aliases]
        asked: list[str] = []

        class _Counting(Mapping):
            def __getitem__(self, name: str) -> torch.Tensor:
                asked.append(name)
                return gathered[name]

            def __iter__(self) -> Iterator[str]:
                return iter(order)

            def __len__(self) -> int:
                return len(order)

        def write() -> None:
            if collectives.rank() == 0:
                try:
                    save_streamed(
                        specs, aliases, _Counting(), self.target.uri, max_shard_size=self.target.max_shard_size,
                        metadata=metadata, storage_options=self.target.storage_options,
                    )
                finally:
                    for name in order[len(asked):]:  # a failed write still joins the gathers the others wait in
                        gathered[name]
            else:
                for name in order:
                    gathered[name]

        collectives.all_ranks(write, "gathering and writing the handoff")
        self.report.wrote = True

    def _consolidate(
        self, history: ModuleHistory, host: HostBuffers | None, trained: bool
    ) -> tuple[dict[str, torch.Tensor], zero_engine.GatheredValues]:
        """The stage's weights: fp32 masters where the engine has them, exact entry values where unchanged,
        and gathered partitions for parameters only the engine has (built by zero.Init in this call).

        With ``host``, masters are copied into the module's own (page-locked) tensors instead of fresh memory;
        those of the shards this rank writes stay gathered for the writer's private copy (``host.fresh``).
        """
        specs, aliases = zero_engine.full_specs(self.module)
        gathered = zero_engine.GatheredValues(
            self.module,
            self._to_handoff(history, self._master_names(history) if trained else set()),
            into=host.existing if host is not None else None,
            also_into=host.fresh if host is not None else None,
        )
        entry = self._entry or {}
        wanted = set(specs) if trained else self._fresh_names
        gathered.gather_masters([n for n in specs if n in wanted and n not in aliases])
        values: dict[str, torch.Tensor] = {}
        for name in specs:  # the same order on every rank: each lookup is a collective
            if name in aliases:
                values[name] = values[aliases[name]]  # tied: one tensor
            else:
                values[name] = gathered[name] if name in wanted else entry[name]
        gathered.synchronize()
        return {n: values[n] for n in history.original if n in values}, gathered

    def _master_names(self, history: ModuleHistory) -> set[str]:
        """Parameters whose fp32 masters the live engine holds while the module holds them in 16 bits (built
        in ``configure_model`` under bf16-mixed, or a 16-bit module): the handoff takes the masters."""
        return {
            name
            for name, param in self.module.named_parameters(remove_duplicate=False)
            if name in history.original and history.original[name][0] in (torch.bfloat16, torch.float16)
            and zero_engine.has_fp32_master(param)
        }

    def _to_handoff(self, history: ModuleHistory, masters: set[str]) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """What the handoff holds of an engine value: the fp32 master of a name in ``masters``, else the value
        in the module's original dtype; an unchanged 16-bit value gives back the exact value the stage started
        from, not a round trip through 16 bits."""
        entry = self._entry or {}

        def to_original(name: str, value: torch.Tensor) -> torch.Tensor:
            if name in masters:
                return value.to(torch.float32)
            dtype = history.original.get(name, (value.dtype, None))[0]
            if value.dtype != dtype:
                before = entry.get(name)
                if before is not None and _bitwise_equal(before.to("cpu", value.dtype), value):
                    return before.to("cpu", dtype)
            return value.to(dtype)

        return to_original

    def _prepare_host(self, tensors: Mapping[str, torch.Tensor]) -> HostBuffers | None:
        """Host memory for a training stage's end, made ready while it runs: the module's own fp32 CPU tensors
        (which this boundary keeps alive anyway) take the masters in place, new ones are made for parameters
        zero.Init built (whose module tensors are empty placeholders), and this rank gets private buffers for
        the shards it writes in the background, which later changes to the module cannot reach."""
        assert self.history is not None
        specs, aliases = self._entry_specs(tensors)
        trainable = {n for n, p in self.module.named_parameters() if p.requires_grad}  # tied: first name only
        fp32 = {n for n in trainable if self.history.original[n][0] == torch.float32}
        sixteen = {n for n in trainable if self.history.original[n][0] in (torch.bfloat16, torch.float16)}
        into = {n: tensors[n] for n in fp32 - self._fresh_names if tensors[n].device.type == "cpu"
                and tensors[n].dtype == torch.float32}
        new = {n: (torch.Size(specs[n]["shape"]), torch.float32) for n in (fp32 & self._fresh_names) | sixteen}
        if not into and not new:
            return None
        written_here = self._names_this_rank_writes(specs, aliases)
        # a 16-bit parameter's master stays stagesafe's own (the module gets a cast): no private copy needed
        private = {n: (torch.Size(specs[n]["shape"]), torch.float32) for n in [*into, *new]
                   if n in written_here and n not in sixteen}
        lock_on = self.device if self.device is not None and self.device.type == "cuda" else None
        return HostBuffers(into, private, new=new, lock_on=lock_on)

    def _entry_specs(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, dict], dict[str, str]]:
        """Name -> ``{"dtype", "shape"}`` of what this stage's end will hand off (original dtypes, full shapes,
        zero.Init's parameters included), and the tied names: what the write will plan its shards from."""
        assert self.history is not None
        params = dict(self.module.named_parameters(remove_duplicate=False))
        first: dict[int, str] = {}
        aliases = {}
        for name, param in params.items():
            canonical = first.setdefault(id(param), name)
            if canonical != name:
                aliases[name] = canonical
        specs = {}
        for name, tensor in tensors.items():
            shape = getattr(params[name], "ds_shape", tensor.shape) if name in self._fresh_names else tensor.shape
            specs[name] = {"dtype": str(self.history.original[name][0]).removeprefix("torch."), "shape": list(shape)}
        return specs, aliases

    def _names_this_rank_writes(self, specs: Mapping[str, dict], aliases: Mapping[str, str]) -> set[str]:
        """The names whose shards this rank will write in the background, planned once per boundary (which
        shard a tensor lands in depends on names and sizes only, the same at the stage's start and end)."""
        if self._written_here is None:
            self._written_here = names_written_by(
                specs, aliases, max_shard_size=self.target.max_shard_size, rank=collectives.rank(),
                writers=self.writer.writers,
            )
        return self._written_here

    def _private_copies(
        self, values: Mapping[str, torch.Tensor], gathered: zero_engine.GatheredValues | None
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None] | None]:
        """What a background writer reads: for the shards this rank writes, private copies the user cannot
        change (those the writer fills from the gathered masters, clones of the rest, made now, while the job
        waits); the other names as they are. Also the writer's fill step."""
        if self._written_here is None:  # a stage whose end was not planned for (no host memory was prepared)
            plan = plan_handoff(values, max_shard_size=self.target.max_shard_size)
            self._names_this_rank_writes(plan.tensors, plan.aliases)
        mine = self._written_here
        copied = gathered.copied if gathered is not None else {}
        reachable = {t.data_ptr() for t in state_tensors(self.module).values() if t.numel()}
        by_id: dict[int, torch.Tensor] = {}
        private = dict(values)
        for name in mine:
            value = values.get(name)
            if value is None or (value.data_ptr() not in reachable and name not in copied):
                continue  # a kept fp32 master: no user code can change it
            if id(value) not in by_id:  # tied names share one tensor, and one copy
                if name in copied:
                    by_id[id(value)] = copied[name]
                else:
                    by_id[id(value)] = value.clone()
                    self.report.copied_while_waiting += value.nbytes
            private[name] = by_id[id(value)]
        return private, (gathered.fill_copies if gathered is not None else None)

    def _restore(self, values: Mapping[str, torch.Tensor], history: ModuleHistory) -> None:
        """Give the module plain tensors holding ``values``, in its original dtype and device."""
        placed = {}
        for name, value in values.items():
            dtype, device = history.original.get(name, (value.dtype, value.device))
            placed[name] = value.to(device="cpu" if device.type == "meta" else device, dtype=dtype)
        assign_values(self.module, placed)


def _absence(target: HandoffTarget) -> tuple[bool, str] | None:
    """Why the handoff at ``target`` is not there whole (``missing``: it is gone), or None."""
    try:
        check_present(target.uri, storage_options=target.storage_options)
    except HandoffNotFoundError as exc:
        return True, str(exc)
    except HandoffCorruptError as exc:
        return False, str(exc)
    return None


def _join_elsewhere(history: ModuleHistory | None, writer: HandoffWriter) -> None:
    """A write of this module's handoff by another strategy's writer (an earlier Trainer) is joined now."""
    other = history.writer if history is not None else None
    if other is not None and other is not writer and other.pending:
        other.join()


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class _PhaseClock:
    """Records the seconds since the previous mark under each phase name."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into = into
        self.last = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = now - self.last
        self.last = now
