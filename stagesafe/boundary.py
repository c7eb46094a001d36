"""One Trainer call's passage through a DeepSpeed engine: enter, engine built, exit.

Knows nothing of Lightning. ``enter`` refuses a module with stale DeepSpeed state and makes sure a handoff
holds the module's current weights; ``engine_built`` loads the exact fp32 values into the engine's masters;
``exit`` consolidates (after training), publishes the handoff, destroys the engine and gives the module back
plain tensors in the dtype and device it had before its first stage.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from . import _dist, _zero
from .errors import StaleDeepSpeedStateError
from .restore import assign_values, restore
from .store import load_state_dict, save_state_dict

__all__ = ["HandoffTarget", "BoundaryReport", "StageBoundary", "assert_clean"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandoffTarget:
    """Where a module's handoff lives."""

    uri: str
    storage_options: Mapping[str, Any] | None = None
    max_shard_size: int | str = "1GB"


@dataclass
class BoundaryReport:
    """What one stage boundary did, for logs and the demo."""

    stage: str
    uri: str
    seconds: float = 0.0  # leaving the stage: consolidate, publish, destroy, restore
    enter_seconds: float = 0.0  # entering it: clean check, and the first handoff when one was needed
    enter_wrote: bool = False  # entering it wrote a handoff (the module's weights were not in one yet)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step of leaving
    wrote: bool = False
    handoff_bytes: int = 0
    stale_problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.stale_problems


@dataclass
class _ModuleRecord:
    """What stagesafe remembers about a module between Trainer calls."""

    original: dict[str, tuple[torch.dtype, torch.device]]
    target: HandoffTarget | None = None
    fingerprint: dict[str, tuple[int, int]] | None = None
    handoff_bytes: int = 0
    pending: "concurrent.futures.Future[dict] | None" = None  # a publish still running in the background


_RECORDS: "weakref.WeakKeyDictionary[nn.Module, _ModuleRecord]" = weakref.WeakKeyDictionary()


def assert_clean(module: nn.Module) -> None:
    """Raise :class:`StaleDeepSpeedStateError` when the module still carries an earlier engine's state."""
    problems = _zero.find_stale_state(module)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise StaleDeepSpeedStateError(
            f"The module still carries state of an earlier DeepSpeed engine: {shown}. Building a new engine over it "
            "would re-adopt stale ZeRO partitions. Run every stage through StageSafeDeepSpeedStrategy, or load the "
            "weights into a fresh module with stagesafe.restore(module, handoff_uri)."
        )


def _state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach() for name, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}


def _fingerprint(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Identity and in-place version of each tensor: unchanged means the values are unchanged."""
    return {name: (t.data_ptr(), t._version) for name, t in tensors.items()}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _start_in_background(publish: Any) -> "concurrent.futures.Future[dict] | None":
    """Run ``publish`` on rank 0 in a daemon thread; other ranks hold no future (they learn the outcome later)."""
    if _dist.rank() != 0:
        return concurrent.futures.Future()
    future: concurrent.futures.Future[dict] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(publish())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, never swallowed
            future.set_exception(exc)

    threading.Thread(target=run, name="stagesafe-publish", daemon=True).start()
    return future


def _wait_pending(record: _ModuleRecord) -> None:
    """Join a background publish; a failure on rank 0 is raised on every rank."""
    pending, record.pending = record.pending, None
    if pending is None:
        return
    try:
        manifest = _dist.on_rank_zero(pending.result, "writing the handoff (in the background)")
    except BaseException:
        record.fingerprint = None  # the handoff does not hold the module's weights: the next stage rewrites it
        raise
    if manifest:  # rank 0, which reports sizes
        record.handoff_bytes = int(manifest["total_size"])


class _PhaseClock:
    """Records the seconds since the previous mark under each phase name."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into = into
        self.last = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = now - self.last
        self.last = now


class StageBoundary:
    """The life of one Trainer call's engine over ``module``; create one per call."""

    def __init__(self, module: nn.Module, target: HandoffTarget, stage: str) -> None:
        self.module = module
        self.target = target
        self.stage = stage
        self._footprint: _zero.ModuleFootprint | None = None
        self._entry: dict[str, torch.Tensor] | None = None
        self._entry_fingerprint: dict[str, tuple[int, int]] | None = None
        self._loaded: dict[str, torch.Tensor] | None = None
        self.report = BoundaryReport(stage=stage, uri=target.uri)

    # -- entering -------------------------------------------------------------------------------------------
    def enter(self, metadata: Mapping[str, Any], *, resume_from: HandoffTarget | None = None) -> None:
        """Check the module is clean and make sure the handoff holds its current weights.

        ``resume_from``: a handoff (perhaps written by another job, at another world size) whose weights the
        module takes before its first stage under stagesafe; ignored for a module that has been through one.
        """
        start = time.perf_counter()
        assert_clean(self.module)
        record = _RECORDS.get(self.module)
        if record is not None:
            _wait_pending(record)
        elif resume_from is not None:
            source = resume_from
            _dist.all_ranks(
                lambda: restore(self.module, source.uri, storage_options=source.storage_options),
                f"reading the handoff to resume from at {source.uri} (every rank reads it: a node-local path is "
                "not visible from other nodes; use shared storage or an object store)",
            )
        tensors = _state_tensors(self.module)
        if record is None:
            record = _ModuleRecord(original={n: (t.dtype, t.device) for n, t in tensors.items()})
            _RECORDS[self.module] = record
        fingerprint = _fingerprint(tensors)
        if record.target != self.target or record.fingerprint != fingerprint:
            cpu = {n: t.to("cpu") for n, t in tensors.items()}
            manifest = _dist.on_rank_zero(
                lambda: self._publish(cpu, {**metadata, "stage": f"before {self.stage}"}), "writing the first handoff"
            )
            record.handoff_bytes = int(manifest["total_size"]) if manifest else 0
            record.target = self.target
            record.fingerprint = fingerprint
            self.report.enter_wrote = True
        self._footprint = _zero.take_footprint(self.module)
        self._entry = tensors
        self._entry_fingerprint = fingerprint
        self.report.enter_seconds = time.perf_counter() - start

    def engine_built(self, *, training: bool) -> None:
        """Give the new engine's optimizer the exact fp32 values instead of ones rebuilt from 16-bit weights."""
        if training and self._entry is not None:
            entry = self._entry
            _dist.all_ranks(lambda: _zero.set_fp32_masters(self.module, entry), "loading the fp32 master weights")
            masters = {n for n, p in self.module.named_parameters(remove_duplicate=False) if _zero.has_fp32_master(p)}
            # The masters now hold the trainable values; keep only what the engine cannot give back exactly.
            self._entry = {n: t for n, t in self._entry.items() if n not in masters}

    def checkpoint_loaded(
        self, values: Mapping[str, torch.Tensor], engine_module: nn.Module, *, training: bool
    ) -> None:
        """A checkpoint's full weights were loaded during the stage: put them in the engine, keep them for exit."""
        _zero.load_values_into_engine(engine_module, values, set_masters=training)
        self._loaded = dict(values)

    # -- leaving ----------------------------------------------------------------------------------------------
    def exit(
        self, engine: Any | None, *, trained: bool, metadata: Mapping[str, Any], background: bool = False
    ) -> BoundaryReport:
        """Consolidate, publish, destroy and restore; every rank must call this.

        ``background``: publish in a thread so that destroy and restore overlap the upload; the caller must
        then call :meth:`wait_published` (on every rank) before it reports the stage as done.
        """
        start = time.perf_counter()
        mark = _PhaseClock(self.report.phases)
        record = _RECORDS[self.module]
        failure: BaseException | None = None  # raised at the end, once the module is clean again
        values: dict[str, torch.Tensor] | None = None
        try:
            if engine is not None and trained:
                values = _dist.all_ranks(lambda: self._consolidate(record), "consolidating the ZeRO shards")
            elif self._loaded is not None:
                values = {
                    n: v.detach().to("cpu", record.original[n][0])
                    for n, v in self._loaded.items()
                    if n in record.original
                }
        except BaseException as exc:  # noqa: BLE001 - the module falls back to the last handoff, then we raise
            failure, values = exc, None
        mark("consolidate")
        if engine is not None:
            _zero.destroy_engine(engine)
        _zero.strip_deepspeed_state(self.module, self._footprint)
        mark("destroy")
        published = True
        if values is not None:
            self.report.wrote = True
            publish_values, publish_meta = values, {**metadata, "stage": self.stage}
            if background:
                record.pending = _start_in_background(lambda: self._publish(publish_values, publish_meta))
            else:
                try:
                    manifest = _dist.on_rank_zero(
                        lambda: self._publish(publish_values, publish_meta), "writing the handoff"
                    )
                    record.handoff_bytes = int(manifest["total_size"]) if manifest else record.handoff_bytes
                except BaseException as exc:  # noqa: BLE001 - the module still gets the new weights; then we raise
                    failure, published = failure or exc, False
        else:
            values = self._unchanged_values(record)
        mark("publish")
        self._restore(values, record)
        if not published:
            record.fingerprint = None  # the handoff does not hold these weights: the next stage rewrites it
        mark("restore")
        self.report.handoff_bytes = record.handoff_bytes
        self.report.stale_problems = _zero.find_stale_state(self.module)
        self.report.seconds = time.perf_counter() - start
        self._entry = self._loaded = None
        if failure is not None:
            raise failure
        return self.report

    def wait_published(self) -> float:
        """Block until a background publish is committed; raise its failure on every rank. Returns seconds waited."""
        start = time.perf_counter()
        record = _RECORDS.get(self.module)
        if record is not None:
            _wait_pending(record)
        waited = time.perf_counter() - start
        self.report.phases["publish_wait"] = waited
        self.report.handoff_bytes = record.handoff_bytes if record is not None else self.report.handoff_bytes
        return waited

    def _consolidate(self, record: _ModuleRecord) -> dict[str, torch.Tensor]:
        """The trained weights: fp32 masters where the engine has them, exact entry values where unchanged."""
        entry = self._entry or {}

        def to_original(name: str, value: torch.Tensor) -> torch.Tensor:
            dtype = record.original.get(name, (value.dtype, None))[0]
            before = entry.get(name)
            if value.dtype != dtype and before is not None and _bitwise_equal(before.to("cpu", value.dtype), value):
                return before.to("cpu")  # unchanged during the stage: keep the exact value, not a 16-bit round trip
            return value.to(dtype)

        values = {name: value for name, value, _ in _zero.iter_consolidated(self.module, to_dtype=to_original)}
        for alias, param in self.module.named_parameters(remove_duplicate=False):
            if alias not in values:  # tied parameters share one tensor, as in the module
                canonical = next(n for n, p in self.module.named_parameters(remove_duplicate=True) if p is param)
                values[alias] = values[canonical]
        return {n: values[n] for n in record.original if n in values}

    def _unchanged_values(self, record: _ModuleRecord) -> dict[str, torch.Tensor]:
        """After a stage that changed nothing: the entry tensors if untouched, else the handoff itself."""
        entry, before = self._entry, self._entry_fingerprint or {}
        untouched = entry is not None and _fingerprint(entry) == {n: before.get(n) for n in entry}
        if untouched and set(entry) == set(record.original):
            return entry
        return load_state_dict(self.target.uri, storage_options=self.target.storage_options)

    def _publish(self, values: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> dict:
        start = time.perf_counter()
        try:
            return self._write(values, metadata)
        finally:
            self.report.phases["handoff_write"] = time.perf_counter() - start  # on rank 0, perhaps in a thread

    def _write(self, values: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> dict:
        dtypes = {
            n: str(record_dtype).replace("torch.", "")
            for n, (record_dtype, _) in _RECORDS[self.module].original.items()
        }
        return save_state_dict(
            values,
            self.target.uri,
            max_shard_size=self.target.max_shard_size,
            metadata={**metadata, "original_dtypes": dtypes},
            storage_options=self.target.storage_options,
        )

    def _restore(self, values: Mapping[str, torch.Tensor], record: _ModuleRecord) -> None:
        """Give the module plain tensors holding ``values``, in its original dtype and device."""
        placed = {}
        for name, value in values.items():
            dtype, device = record.original.get(name, (value.dtype, value.device))
            placed[name] = value.to(device=device, dtype=dtype)
        assign_values(self.module, placed)
        record.target = self.target
        record.fingerprint = _fingerprint(_state_tensors(self.module))
