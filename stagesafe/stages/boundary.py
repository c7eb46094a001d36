"""One Trainer call's passage through a DeepSpeed engine: enter, engine built, exit.

Knows nothing of Lightning. ``enter`` refuses a module with stale DeepSpeed state; ``engine_built`` loads the
exact fp32 values into the engine's masters (the kept fp32 masters where the module holds 16 bits); ``exit``
decides once where the stage's weights come from (:mod:`~stagesafe.stages.weight_source`), then takes them
(the fp32 masters after training), keeps what the engine held beyond them
(:class:`~stagesafe.stages.history.KeptTraining`: masters of 16-bit parameters, the optimizer's partition),
destroys the engine, restores the module to plain tensors in the dtype and device it had before its first
stage, and publishes: has the handoff (fp32 wherever training had masters) written when it does not hold them
yet (by the strategy's :class:`~stagesafe.stages.writer.HandoffWriter`, in the background unless asked
otherwise). What the entry checks and reads before any engine (a clean module, ``resume_from``'s weights, the
handoff still there) is :mod:`~stagesafe.stages.stage_entry`'s; the end's plan, host memory and kept state are
:mod:`~stagesafe.stages.stage_end`'s; taking weights from the engine is :mod:`~stagesafe.stages.engine_weights`'.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stagesafe.boundary_report import BoundaryReport
from stagesafe.errors import InvalidArgumentError
from stagesafe.handoff.read import HandoffReader
from stagesafe.handoff.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size
from stagesafe.stages import collectives
from stagesafe.stages.between_calls import follow_parameters
from stagesafe.stages.engine_weights import take_from_engine
from stagesafe.stages.exit_steps import FirstFailure, PhaseClock, no_collector_passes
from stagesafe.stages.history import (
    HandoffTarget,
    KeptTraining,
    ModuleHistory,
    fingerprint,
    history_of,
    state_tensors,
)
from stagesafe.stages.optimizer_handoff import forget_optimizer_handoff, write_optimizer_handoff
from stagesafe.stages.publish import HandoffPublisher, handoff_metadata
from stagesafe.stages.shared_state import share_moments
from stagesafe.stages.stage_end import StageEnd
from stagesafe.stages.stage_entry import assert_clean, build_from_handoff, check_still_there, first_stage
from stagesafe.stages.weight_source import WeightSource, weight_sources
from stagesafe.stages.writer import HandoffWriter
from stagesafe.restore import assign_values
from stagesafe.zero import engine as zero_engine

__all__ = ["StageBoundary", "StageOptions"]

log = logging.getLogger(__name__)

# What the optimizer state's JSON says of where it comes from, beside the weights' own metadata.
_SOURCE_KEYS = ("stage", "global_step", "epoch", "world_size", "zero_stage")

# Sources of weights that come from this stage: the handoff's metadata names it.
_FROM_THIS_STAGE = (WeightSource.STREAMED, WeightSource.MASTERS, WeightSource.CHECKPOINT)


@dataclass(frozen=True)
class StageOptions:
    """How one Trainer call's boundary runs, fixed for the call.

    ``meta``: between stages the module holds meta tensors; ``materialize(values)`` then builds the next
    engine's partitions from the handoff, read one shard at a time. ``training``: the stage trains on
    ``device``, so host memory for its end is prepared while it runs. ``fresh``: ids of the parameters (whose
    values only the engine has) and floating buffers ``zero.Init`` built in this call. ``keep_optimizer_state``:
    a training stage's end keeps this rank's files of DeepSpeed's checkpoint (``exclude_frozen``: without
    frozen parameters, as ``save_checkpoint`` would). ``check_host_memory``: a training stage asks the host
    for its end's memory before its first step (:mod:`~stagesafe.stages.host_budget`).
    ``handoff_optimizer_state``: a training stage's end writes the optimizer state beside the weights, per
    parameter (:mod:`~stagesafe.stages.optimizer_handoff`). ``max_shard_size``: the largest shard, in bytes.
    """

    stage: str
    meta: bool = False
    materialize: Callable[[Mapping[str, torch.Tensor]], None] | None = None
    training: bool = False
    device: torch.device | None = None
    fresh: frozenset[int] = frozenset()
    keep_optimizer_state: bool = True
    exclude_frozen: bool = False
    check_host_memory: bool = True
    handoff_optimizer_state: bool = False
    max_shard_size: int = parse_size(DEFAULT_MAX_SHARD_SIZE)


@dataclass
class _Entry:
    """What the module held when the stage started, kept for its end."""

    values: Mapping[str, torch.Tensor] | None = None  # its tensors (not zero.Init's), or a meta module's handoff
    masters: dict[str, torch.Tensor] = field(default_factory=dict)  # kept fp32 masters of 16-bit ones among them
    built: set[str] = field(default_factory=set)  # parameters zero.Init built in this call: only the engine has them
    footprint: zero_engine.ModuleFootprint | None = None  # attributes and hooks before the engine


@dataclass
class _Taken:
    """The stage's weights as the end took them: ``values`` None where the module takes nothing back."""

    source: WeightSource
    values: dict[str, torch.Tensor] | None = None
    gathered: zero_engine.GatheredValues | None = None  # masters kept on the device for the writer's private copy
    failed: tuple[WeightSource, ...] = ()  # the sources tried first, whose taking failed


class StageBoundary:
    """The life of one Trainer call's engine over ``module``; create one per call."""

    def __init__(
        self, module: nn.Module, target: HandoffTarget, options: StageOptions, *, writer: HandoffWriter
    ) -> None:
        self.module = module
        self.target = target
        self.writer = writer
        self.options = options
        self.end = StageEnd(  # the stage's end: its plan (made at entry), host memory and kept state
            device=options.device, max_shard_size=options.max_shard_size, writers=writer.writers,
            training=options.training, keep_optimizer_state=options.keep_optimizer_state,
            exclude_frozen=options.exclude_frozen, stage=options.stage, check_memory=options.check_host_memory,
            module_holds_weights=not options.meta,
        )
        self._entry = _Entry()
        self._loaded: dict[str, torch.Tensor] | None = None  # a ckpt_path's weights, loaded during the stage
        self._meta_values: dict[str, torch.Tensor] | None = None  # what place_meta() gives the module
        self._stepped = False  # an optimizer step was taken in this call
        self._unwritten: dict[str, torch.Tensor] | None = None  # an inference stage's weights, for loop_started
        self.history: ModuleHistory | None = None
        self.resumed: HandoffTarget | None = None  # resume_from, while the module holds the weights it took there
        self.report = BoundaryReport(stage=options.stage, uri=target.uri)
        self._publisher = HandoffPublisher(module, target, writer, self.end, self.report)

    # -- entering -------------------------------------------------------------------------------------------
    @no_collector_passes()
    def enter(self, *, resume_from: HandoffTarget | None = None, weights_from: Mapping[str, Any] | None = None) -> None:
        """Check the module is clean; note what it holds.

        ``resume_from``: a handoff (perhaps written by another job, at another world size) whose weights the
        module takes before its first stage under stagesafe; ignored for a module that has been through one.
        A module on the meta device (meta mode) is not loaded: its engine is built from that handoff.
        ``weights_from``: this call's stage and step, which the handoff's metadata names for the weights a
        module brings to its first stage (no stage trained them: the first call that writes them is named).
        """
        start = time.perf_counter()
        assert_clean(self.module, fresh=self.options.fresh)  # before anything changes
        history = history_of(self.module)
        _join_elsewhere(history, self.writer)
        self.writer.wait_device()  # the last stage's host memory is unlocked before it is locked again
        tensors = state_tensors(self.module)
        built = self._built_names()
        on_meta = any(t.device.type == "meta" for t in tensors.values())
        if on_meta and self.options.materialize is None:
            raise InvalidArgumentError(
                "the module holds meta tensors: load weights first (stagesafe.restore(module, uri)), or run the "
                "stage with StageSafeDeepSpeedStrategy(between_stages='meta')"
            )
        if history is None:
            tensors, history = first_stage(self.module, tensors, resume_from=resume_from, target=self.target,
                                           on_meta=on_meta, weights_from=weights_from or {})
        if resume_from is not None and history.weights_from.get("resumed_from") == resume_from.uri:
            self.resumed = resume_from  # no call has changed the weights it took (inference calls, a fit with no step)
        history.note_names(tensors, fresh=built)
        self.history = history
        self.end.take_over_kept_state(history)  # a fit's engine makes its own: the last one's goes now
        check_still_there(history, self.target, self.writer, on_meta=on_meta)
        footprint = zero_engine.take_footprint(self.module, fresh=self.options.fresh)
        if on_meta:
            assert self.options.materialize is not None
            reader = build_from_handoff(history, self.writer, self.options.materialize)
            self._entry = _Entry(reader, built=built, footprint=footprint)
        else:
            entry = {n: t for n, t in tensors.items() if n not in built}
            masters = history.kept.masters_for(entry) if history.kept is not None else {}
            self._entry = _Entry(entry, masters=masters, built=built, footprint=footprint)
            self._prepare_end(history, tensors)
            if self.options.device is not None:  # the engine's 16-bit cast then happens there, not in host memory
                zero_engine.place_for_engine(self.module, self.options.device)
        self.report.enter_seconds = time.perf_counter() - start

    def _built_names(self) -> set[str]:
        """The parameters zero.Init built in this call (partitioned: their values are the engine's)."""
        params = self.module.named_parameters(remove_duplicate=False)
        return {n for n, p in params if id(p) in self.options.fresh and zero_engine.is_zero3_param(p)}

    def _prepare_end(self, history: ModuleHistory, tensors: Mapping[str, torch.Tensor]) -> None:
        """While the stage runs: the end's plan is made, and a training stage's host memory made ready; an
        inference stage, which ends with the weights it started with, has them written once its loop starts
        (:meth:`loop_started`) if no handoff holds them."""
        entry = self._entry
        self.end.plan_for(self.module, tensors, original=history.original, built=entry.built, kept=set(entry.masters))
        if self.options.training:
            if not self.options.meta:
                values = entry.values
                assert isinstance(values, dict)
                self.end.prepare_weights(self.module, values, history, built=entry.built, masters=entry.masters)
            return
        if entry.built or history.holds(self.target, tensors):
            return
        self._unwritten = dict(tensors)

    def loop_started(self) -> None:
        """An inference stage's loop starts: Lightning has restored its ``ckpt_path`` by now, so a call whose
        arguments fail late has written nothing. The weights the stage started with are written now if no
        handoff holds them, from the tensors this boundary keeps (the engine computes on copies of its own);
        the end joins the write. A checkpoint's weights, loaded instead, are written by the end."""
        tensors, self._unwritten = self._unwritten, None
        if tensors is None or self._loaded is not None:
            return
        entry = self._entry
        assert isinstance(entry.values, dict)
        self._join_last_write()
        values = {n: t.to("cpu") for n, t in {**entry.values, **entry.masters}.items()}
        self._publisher.start(self._entered(), values, tensors, gathered=None, background=False)

    def engine_built(self, engine: Any, *, training: bool) -> None:
        """Give the new engine's optimizer the exact fp32 values instead of ones rebuilt from 16-bit weights;
        start making host memory ready for the optimizer state the stage's end keeps, as far as it is known."""
        start, entry = time.perf_counter(), self._entry
        if training and entry.values is not None:
            values = {**entry.values, **entry.masters} if entry.masters else entry.values  # a reader stays lazy
            collectives.all_ranks(lambda: zero_engine.set_fp32_masters(self.module, values),
                                  "loading the fp32 master weights")
        self.end.engine_built(engine, self.module, last_write=self.writer)
        self.report.enter_seconds += time.perf_counter() - start

    def optimizer_stepped(self, engine: Any) -> None:
        """After an optimizer step: the first time, the optimizer state it made is sized for the end's copy."""
        self._stepped = True
        self.end.optimizer_stepped(engine)

    def checkpoint_loaded(
        self, values: Mapping[str, torch.Tensor], engine_module: nn.Module, *, training: bool
    ) -> None:
        """A checkpoint's full weights were loaded during the stage: put them in the engine, keep them for exit."""
        zero_engine.load_values_into_engine(engine_module, values, set_masters=training)
        self._loaded = dict(values)

    # -- leaving ----------------------------------------------------------------------------------------------
    @no_collector_passes()
    def exit(
        self,
        engine: Any | None,
        *,
        trained: bool,
        weights_from: Mapping[str, Any],
        gather: bool,
        background: bool,
        lr_schedulers: Sequence[Mapping[str, Any]] = (),
        failed: bool = False,
        state_places: zero_engine.StatePlaces | None = None,
    ) -> BoundaryReport:
        """Decide where the stage's weights come from; take them, keep what the engine held beyond them,
        destroy the engine, restore the module, and publish the handoff. A failure of any step is raised at
        the end, once the module is plain again.

        ``gather``: every rank is here (the stage ended, or failed, on all of them), so weights may be gathered
        from the engine; without it a rank keeps the weights the stage started with. ``background``: the
        write may outlast the call (joined by the next stage, ``wait_for_handoff()`` or the exit).
        ``weights_from``: stage and step that new weights come from, for the handoff's metadata.
        ``lr_schedulers``: the trainer's lr scheduler states, kept beside the optimizer's.
        ``failed``: the call failed, on this rank or another. Before any optimizer step it trained nothing worth
        keeping on storage (a ``ckpt_path`` typo, a bad batch), so it writes no handoff: the module keeps its
        weights, and the folder what it held. ``state_places``: where the optimizer's state lies in the kept
        files (read from the engine with the optimizer's layout); at several ranks of one host they share it
        whole per parameter (:mod:`~stagesafe.stages.shared_state`).
        """
        start, clock, failure = time.perf_counter(), PhaseClock(self.report.phases), FirstFailure()
        history = self._entered()
        failure.attempt(self._join_last_write)  # one write at a time; its failure is raised once this stage is safe
        clock("join_last_write")
        self.end.hold_kept_state()  # until the kept state's own copy: the weights' copies and this call first
        try:
            meta_specs = zero_engine.full_specs(self.module)[0] if self.options.meta else {}  # before the engine goes
            keeps_meta = self._leave(engine, history, trained=trained, weights_from=weights_from, gather=gather,
                                     background=background, lr_schedulers=lr_schedulers, clock=clock, failure=failure,
                                     write=not failed or self._stepped, state=not failed, places=state_places)
        except BaseException:
            self.end.release_kept_state_hold()  # no copy will come to end the hold
            if history.kept is not None and history.kept.shared is not None:
                history.kept.shared.give_up()  # no rank waits for this one's part of the shared state
            if history.kept is not None and history.kept.copied is not None:
                history.kept.copied.set()  # nor one that a given-back optimizer's state may wait for
            raise
        if keeps_meta and failure.error is None:  # placed by place_meta(), once Lightning's teardown moved the module
            self._meta_values = _meta_tensors(meta_specs, history)
        self.report.stale_problems = zero_engine.find_stale_state(self.module)
        self.report.seconds = time.perf_counter() - start
        self._entry.values = self._loaded = None
        failure.raise_first()
        return self.report

    def _leave(
        self, engine: Any | None, history: ModuleHistory, *, trained: bool, weights_from: Mapping[str, Any],
        gather: bool, background: bool, lr_schedulers: Sequence[Mapping[str, Any]], clock: PhaseClock,
        failure: FirstFailure, write: bool = True, state: bool = True,
        places: zero_engine.StatePlaces | None = None,
    ) -> bool:
        """:meth:`exit`'s steps, in order. Returns whether the module is left on the meta device. ``state``: the
        optimizer state may be handed off (every rank ended the call well)."""
        host = self.end.weights_ready()
        clock("host_memory_ready")
        sources = self._weight_sources(engine, history, trained=trained, gather=gather)
        keep_for = self.end.private_names if background else set()
        taken = self._take(sources, engine, history, host, keep_for, weights_from, failure)
        clock("consolidate")
        if taken.gathered is not None:  # of which: waiting for the device's copies (the rest is the host's)
            self.report.phases["consolidate_device_wait"] = taken.gathered.waited
        state_folder = self._hand_off_optimizer(engine, taken, history, failure) if state and gather else None
        kept, later = self._keep_engine_state(engine, taken, history, lr_schedulers, clock, later=background)
        if kept is not None and places is not None and places.flats and state and gather:
            self._share_kept_state(kept, places)
            clock("share_kept_state")
        self._destroy(engine)
        clock("destroy")
        handoff = self._restore(taken, history)
        restored = state_tensors(self.module)
        if state_folder is not None:
            history.bind_state(self.target.uri, restored)
        self._remember(kept, history, restored, copied=later is None)
        keeps_meta = self.options.meta and WeightSource.STREAMED not in taken.failed
        copy_kept = self.end.kept_state_copy(later, history) if later is not None else None
        if not write and not keeps_meta:  # the module holds the weights: nothing is lost by writing none
            log.info("stagesafe: the %s call failed before any optimizer step: no handoff written; %s is as it was",
                     self.options.stage, self.target.uri)
            handoff = None
        if not self._publish(taken, history, handoff, restored, failure, gather=gather,
                             background=background and not keeps_meta, keep=copy_kept,
                             state_folder=state_folder) and copy_kept is not None:
            copy_kept()  # no write took it to its device thread: now
        clock("publish")
        return keeps_meta

    def place_meta(self) -> None:
        """Meta mode, after Lightning's teardown (which moves the module with ``.cpu()``): the module's tensors
        become meta tensors, holding no memory until the next stage reads the handoff."""
        values, self._meta_values = self._meta_values, None
        if values is None:
            return
        history = self._entered()
        before = fingerprint(state_tensors(self.module))
        assign_values(self.module, values)
        follow_parameters(self.module)  # new parameter objects: the given-back optimizer follows them
        if history.kept is not None:
            history.kept.moved(before, state_tensors(self.module))
        if self.report.wrote or history.target is None:
            history.target = self.target
        history.fingerprint = fingerprint(state_tensors(self.module))
        self.report.stale_problems = zero_engine.find_stale_state(self.module)

    # -- the steps of exit --------------------------------------------------------------------------------
    def _entered(self) -> ModuleHistory:
        assert self.history is not None, "exit() without enter()"
        return self.history

    def _join_last_write(self) -> None:
        """One write at a time: the last one (any strategy's) ends before this stage's starts."""
        _join_elsewhere(self.history, self.writer)
        if self.writer.pending:
            self.writer.join()

    def _weight_sources(
        self, engine: Any | None, history: ModuleHistory, *, trained: bool, gather: bool
    ) -> tuple[WeightSource, ...]:
        """Where the stage's weights come from, decided once: the first source, then the fallbacks."""
        return weight_sources(
            engine=engine is not None, gather=gather, trained=trained, meta=self.options.meta,
            built_here=bool(self._entry.built), loaded=self._loaded is not None,
            in_handoff=history.target == self.target and history.fingerprint is not None,
        )

    def _take(
        self,
        sources: tuple[WeightSource, ...],
        engine: Any | None,
        history: ModuleHistory,
        host: Mapping[str, torch.Tensor] | None,
        keep_for: set[str],
        weights_from: Mapping[str, Any],
        failure: FirstFailure,
    ) -> _Taken:
        """The weights from the first of ``sources`` that gives them: a failure is noted and the next source
        is tried; the last cannot fail. Weights that come from this stage name it in the handoff's metadata.
        ``host``: where trained masters go; ``keep_for``: names whose masters stay gathered for private copies."""
        *fallible, last = sources
        for tried, source in enumerate(fallible):
            taken = failure.attempt(lambda: self._take_from(source, engine, history, host, keep_for, weights_from))
            if taken is not None:
                break
        else:
            tried, taken = len(fallible), self._take_from(last, engine, history, host, keep_for, weights_from)
        if taken.source in _FROM_THIS_STAGE:
            history.weights_from = dict(weights_from)
        return dataclasses.replace(taken, failed=sources[:tried])

    def _take_from(
        self,
        source: WeightSource,
        engine: Any | None,
        history: ModuleHistory,
        host: Mapping[str, torch.Tensor] | None,
        keep_for: set[str],
        weights_from: Mapping[str, Any],
    ) -> _Taken:
        if source is WeightSource.STREAMED:
            metadata = {**handoff_metadata(history), **weights_from}  # the new weights' stage and step win
            metadata.pop("optimizer", None)  # new weights: the state the resumed ones named is not theirs
            self._publisher.streamed(history, self._entry.values or {}, metadata)
            return _Taken(source)
        if source in (WeightSource.MASTERS, WeightSource.BUILT):
            entry, built, trained = self._entry.values or {}, self._entry.built, source is WeightSource.MASTERS
            values, gathered = collectives.all_ranks(
                lambda: take_from_engine(self.module, history.original, entry, trained=trained, built=built, host=host,
                                         keep_for=keep_for),
                "consolidating the ZeRO shards",
            )
            return _Taken(source, values, gathered)
        if source is WeightSource.CHECKPOINT:
            assert self._loaded is not None
            original = history.original
            loaded = {n: v.detach().to("cpu", original[n][0]) for n, v in self._loaded.items() if n in original}
            return _Taken(source, loaded)
        if source is WeightSource.ENTRY:
            return _Taken(source, self._entry_values(history))
        return _Taken(source)  # the handoff holds them: the module takes nothing back

    def _hand_off_optimizer(
        self, engine: Any | None, taken: _Taken, history: ModuleHistory, failure: FirstFailure
    ) -> str | None:
        """Where asked, the trained engine's optimizer state goes beside the handoff now, while the engine lives,
        committed before the weights, which then name it. Returns its folder; a failure (the optimizer's state is
        not per parameter, storage) is raised once the weights are safe, which are written without it."""
        if not self.options.handoff_optimizer_state or engine is None or taken.source is not WeightSource.MASTERS:
            return None
        source = {"written_by": "StageSafeDeepSpeedStrategy", "url": self.target.uri,
                  **{k: history.weights_from[k] for k in _SOURCE_KEYS if k in history.weights_from}}
        limit, phases = self.end.max_shard_size, self.report.phases
        bound = failure.attempt(lambda: write_optimizer_handoff(engine, self.target, limit, source=source, phases=phases))
        if bound is None:
            return None
        history.weights_from["optimizer"] = bound
        return bound["folder"]

    def _keep_engine_state(
        self, engine: Any, taken: _Taken, history: ModuleHistory, lr_schedulers: Sequence[Mapping[str, Any]],
        clock: PhaseClock, *, later: bool,
    ) -> tuple[KeptTraining | None, zero_engine.LaterCopies | None]:
        """What the engine held beyond the module, where it trained the weights: the fp32 masters of 16-bit
        parameters and this rank's files of DeepSpeed's checkpoint (fingerprinted once the module has them).
        ``later``: the files keep the engine's device tensors, copied off the device after the call returned
        (:meth:`EndMemory.kept_state_copy`), so that the call waits neither for their host memory nor for the copy."""
        trained = taken.source.trained
        if not trained:
            return None, None
        copies = None
        if later:
            checkpoint, missing, copies = self.end.keep_engine_state_later(engine)
        else:
            self.end.kept_state_ready()
            clock("kept_host_memory_ready")
            checkpoint, missing = self.end.keep_engine_state(engine)
        clock("keep_engine_state")
        kept = KeptTraining(
            {}, masters=_masters_in(taken.values or {}, history), checkpoint=checkpoint, missing=missing,
            lr_schedulers=[copy.deepcopy(dict(s)) for s in lr_schedulers], world_size=collectives.world_size(),
            copied=threading.Event() if copies is not None and copies.slots else None,
        )
        return kept, copies

    @staticmethod
    def _share_kept_state(kept: KeptTraining, places: zero_engine.StatePlaces) -> None:
        """Several ranks (every one calls this): where they run on one host, their kept per-element state is to
        be laid out once per host, per parameter; each rank writes its part once its files are on the host (the
        kept state's copy, which the given-back optimizer's state then waits for)."""
        kept.shared = share_moments(kept.checkpoint, places)
        if kept.shared is not None and kept.copied is None:
            kept.copied = threading.Event()

    def _destroy(self, engine: Any | None) -> None:
        """DeepSpeed removes what it registered; then whatever the module's footprint did not have goes."""
        if engine is not None:
            zero_engine.destroy_engine(engine)
        zero_engine.strip_deepspeed_state(self.module, self._entry.footprint)

    def _restore(self, taken: _Taken, history: ModuleHistory) -> dict[str, torch.Tensor] | None:
        """Give the module plain tensors holding the taken weights, in its original dtype and device (each
        parameter object stays). Returns what the handoff holds of them: fp32 masters where there are some."""
        values = taken.values
        if values is None:
            return None
        masters = self._entry.masters if taken.source is WeightSource.ENTRY else _masters_in(values, history)
        placed = {}
        for name, value in values.items():
            dtype, device = history.original.get(name, (value.dtype, value.device))
            placed[name] = value.to(device="cpu" if device.type == "meta" else device, dtype=dtype)
        assign_values(self.module, placed)
        return {**values, **{n: m for n, m in masters.items() if n in values}}

    def _remember(
        self, kept: KeptTraining | None, history: ModuleHistory, restored: Mapping[str, torch.Tensor], *, copied: bool
    ) -> None:
        """New weights' kept engine state is the module's, for the tensors it holds now (``restored``). Once it
        is ``copied`` off the device, its host memory stays locked while that state lives, the rest is unlocked."""
        if kept is not None:
            if history.kept is not None:
                history.kept.drop_views()  # no view outlives the state it looks into
            history.kept = dataclasses.replace(kept, fingerprint=fingerprint(restored))
        if copied:
            self.end.release_kept_state()

    def _publish(
        self,
        taken: _Taken,
        history: ModuleHistory,
        handoff: Mapping[str, torch.Tensor] | None,
        restored: Mapping[str, torch.Tensor],
        failure: FirstFailure,
        *,
        gather: bool,
        background: bool,
        keep: Callable[[], None] | None = None,
        state_folder: str | None = None,
    ) -> bool:
        """Have the handoff written when it does not hold the module's weights: by the writer, with every rank
        here (a foreground write is joined now; its failure is noted); otherwise by rank 0 alone. Whether a
        background write took ``keep`` (device work of this boundary's) to its device thread. ``state_folder``:
        the optimizer state this stage wrote for these weights, deleted if they are not committed."""
        forget = (lambda: forget_optimizer_handoff(self.target, state_folder)) if state_folder is not None else None
        if WeightSource.STREAMED in taken.failed:
            history.lost()  # its write failed: the next stage writes the weights the module now holds
            self.end.unlock()
        elif handoff is None or history.holds(self.target, restored):
            self.end.unlock()
        elif not gather:
            self.end.unlock()
            self._publisher.alone(history, handoff)
        else:
            keep = keep if background else None
            self._publisher.start(history, handoff, restored, gathered=taken.gathered, background=background, keep=keep,
                                  on_failed=forget)
            if not background:
                failure.attempt(self.writer.join)  # the module keeps the new weights; then the failure is raised
            return keep is not None
        return False

    def _entry_values(self, history: ModuleHistory) -> dict[str, torch.Tensor] | None:
        """The weights the stage started with (a stage that changed none, or failed on another rank)."""
        entry = self._entry.values
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


def _masters_in(values: Mapping[str, torch.Tensor], history: ModuleHistory) -> dict[str, torch.Tensor]:
    """The values held in another dtype than the module's original one: fp32 masters of 16-bit parameters."""
    return {n: v for n, v in values.items() if v.dtype != history.original[n][0]}


def _meta_tensors(
    specs: Mapping[str, tuple[torch.Size, torch.dtype]], history: ModuleHistory
) -> dict[str, torch.Tensor]:
    """Meta tensors of the module's full shapes, in its original dtypes."""
    return {
        name: torch.empty(shape, dtype=history.original[name][0], device="meta")
        for name, (shape, _) in specs.items()
        if name in history.original
    }


def _join_elsewhere(history: ModuleHistory | None, writer: HandoffWriter) -> None:
    """A write of this module's handoff by another strategy's writer (an earlier Trainer) is joined now."""
    other = history.writer if history is not None else None
    if other is not None and other is not writer and other.pending:
        other.join()
