"""One Trainer call's passage through a DeepSpeed engine: enter, engine built, exit.

Knows nothing of Lightning. ``enter`` refuses a module with stale DeepSpeed state and makes sure a handoff
holds the module's current weights; ``engine_built`` loads the exact fp32 values into the engine's masters;
``exit`` consolidates (after training), publishes the handoff, destroys the engine and gives the module back
plain tensors in the dtype and device it had before its first stage.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from stagesafe.lightning import dist as _dist

from stagesafe.lightning import inflight as _inflight

from stagesafe.zero import engine as _zero
from stagesafe.handoff.fs import resolve, url_of
from stagesafe.lightning.host import HostBuffers, start_deferred_unlocks
from stagesafe.lightning.shared_write import names_written_by, shared_by_all_ranks, write_share
from stagesafe.errors import StaleDeepSpeedStateError
from stagesafe.restore import assign_values, load_for
from stagesafe.handoff.store import HandoffReader, check_writable, load_state_dict, remove_stale, save_state_dict, save_streamed

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
    copied_while_waiting: int = 0  # bytes cloned for the background writer before the call could return

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
    pending_url: str = ""  # where it writes
    rewrite_next: bool = False  # whether the handoff holds the module's weights is unknown on some ranks


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


def _note_size(record: _ModuleRecord, manifest: Mapping[str, Any] | None) -> None:
    """Remember the handoff's size; only rank 0, which wrote it, has the manifest (and reports sizes)."""
    if manifest:
        record.handoff_bytes = int(manifest["total_size"])


def _start_in_background(
    record: _ModuleRecord, target: HandoffTarget, write: Callable[[str], dict | None], *, every_rank: bool
) -> None:
    """Run ``write(key)`` in a thread that may outlive the Trainer call: on rank 0 (which commits), and with
    ``every_rank`` on the others too (each writes its share). Other ranks learn the outcome when the ranks next
    join it; readers wait for the outcome rank 0 posts under ``key``."""
    url = url_of(*resolve(target.uri, target.storage_options))
    record.pending_url = url
    key = _inflight.next_key(url)
    if _dist.rank() == 0:
        record.pending = _inflight.start(url, key, lambda: write(key))
    elif every_rank:
        record.pending = _inflight.start_share(url, key, lambda: write(key))
    else:
        _inflight.mark_elsewhere(url, key)
        record.pending = concurrent.futures.Future()


def _join_without_collectives(record: _ModuleRecord) -> None:
    """After a failed stage, when collectives may not be trusted: rank 0 joins its write alone. Only rank 0
    knows whether it succeeded, so every rank writes the handoff again at its next stage."""
    pending, record.pending = record.pending, None
    if pending is None:
        return
    if _dist.rank() == 0:
        concurrent.futures.wait([pending])
        if pending.exception() is not None:
            log.error("stagesafe: the last handoff write failed (%s); the next stage writes it again",
                      pending.exception())
    _inflight.forget(record.pending_url)
    record.rewrite_next = True


def _wait_pending(record: _ModuleRecord) -> None:
    """Join a background publish (a collective); a failure on rank 0 is raised on every rank."""
    pending, record.pending = record.pending, None
    if pending is None:
        return
    try:
        manifest = _dist.on_rank_zero(pending.result, "writing the handoff (in the background)")
    except BaseException:
        record.fingerprint = None  # the handoff does not hold the module's weights: the next stage rewrites it
        raise
    finally:
        _inflight.forget(record.pending_url)
    _note_size(record, manifest)


class _Without(Mapping):
    """``entry`` minus some names, without reading anything (``entry`` may read lazily from a handoff)."""

    def __init__(self, entry: Mapping[str, torch.Tensor], drop: set[str]) -> None:
        self._entry, self._drop = entry, drop

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._drop:
            raise KeyError(name)
        return self._entry[name]

    def __iter__(self) -> Iterator[str]:
        return (n for n in self._entry if n not in self._drop)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _on_meta(tensors: Mapping[str, torch.Tensor]) -> bool:
    return any(t.device.type == "meta" for t in tensors.values())


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

    def __init__(
        self,
        module: nn.Module,
        target: HandoffTarget,
        stage: str,
        *,
        meta: bool = False,
        materialize: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        training: bool = False,
        device: torch.device | None = None,
        background: bool = True,
        single_node: bool = True,
    ) -> None:
        """``meta``: between stages the module holds meta tensors; ``materialize(values)`` then builds the next
        engine's partitions from the handoff, read one shard at a time. ``training``: the stage trains on
        ``device``, so host memory for its end is prepared while it runs. ``background``: the handoff of a
        trained stage will be written in the background (from a private copy of the weights), by every rank
        at once when the storage is shared by all of them (``single_node``: a local path is)."""
        self.module = module
        self.target = target
        self.stage = stage
        self.meta = meta
        self.training = training
        self.device = device
        self.background = background
        self._every_rank = (
            background
            and not meta
            and _dist.world_size() > 1
            and shared_by_all_ranks(resolve(target.uri, target.storage_options)[0], single_node=single_node)
        )
        self._host: HostBuffers | None = None
        self._gathered: _zero.GatheredValues | None = None  # holds the writer's private copies, filled by it
        self._written_here: set[str] | None = None
        self._materialize = materialize
        self._meta_values: dict[str, torch.Tensor] | None = None
        self._footprint: _zero.ModuleFootprint | None = None
        self._entry: dict[str, torch.Tensor] | None = None
        self._entry_fingerprint: dict[str, tuple[int, int]] | None = None
        self._loaded: dict[str, torch.Tensor] | None = None
        self.report = BoundaryReport(stage=stage, uri=target.uri)

    # -- entering -------------------------------------------------------------------------------------------
    def enter(self, metadata: Mapping[str, Any], *, resume_from: HandoffTarget | None = None) -> None:
        """Check the module is clean and make sure a handoff holds its current weights.

        ``resume_from``: a handoff (perhaps written by another job, at another world size) whose weights the
        module takes before its first stage under stagesafe; ignored for a module that has been through one.
        A module on the meta device (meta mode) is not loaded: its engine is built from that handoff.
        """
        start = time.perf_counter()
        assert_clean(self.module)
        record = _RECORDS.get(self.module)
        tensors = _state_tensors(self.module)
        on_meta = _on_meta(tensors)
        if on_meta and self._materialize is None:
            raise ValueError(
                "the module holds meta tensors: load weights first (stagesafe.restore(module, uri)), or run the "
                "stage with StageSafeDeepSpeedStrategy(restore='meta')"
            )
        if record is None and resume_from is not None and not on_meta:
            source = resume_from
            placed = _dist.all_ranks(  # every rank loads and checks; none changes its module unless all can
                lambda: load_for(self.module, source.uri, storage_options=source.storage_options),
                f"reading the handoff to resume from at {source.uri} (every rank reads it: a node-local path is "
                "not visible from other nodes; use shared storage or an object store)",
            )
            _zero.strip_deepspeed_state(self.module, None)
            assign_values(self.module, placed)
            tensors = _state_tensors(self.module)
        if record is None:
            record = _ModuleRecord(original={n: (t.dtype, t.device) for n, t in tensors.items()})
            record.target = resume_from if on_meta else None
            _RECORDS[self.module] = record
        fingerprint = _fingerprint(tensors)
        if on_meta or record.target != self.target or record.fingerprint != fingerprint:
            _wait_pending(record)  # this stage reads or rewrites the handoff: the last write must be done first
        # otherwise the last write goes on during this stage, and the stage's end joins it
        if on_meta:
            if record.target is None:
                raise ValueError(
                    "the module holds meta tensors and no handoff holds its weights: pass resume_from=URI, or load "
                    "them with stagesafe.restore(module, uri) first"
                )
        elif record.target != self.target or record.fingerprint != fingerprint:
            cpu = {n: t.to("cpu") for n, t in tensors.items()}
            first = {**metadata, "stage": f"before {self.stage}"}
            if self.background and not self.meta:
                # Written while the engine is built and the stage runs, from tensors this boundary keeps and
                # that nothing changes before the stage's end joins the write (the user's code is not running).
                # A location that cannot be written fails the stage now, not at its end.
                target = self.target
                _dist.on_rank_zero(
                    lambda: check_writable(target.uri, storage_options=target.storage_options),
                    "writing the first handoff",
                )
                self._publish_in_background(record, cpu, first, phase="first_handoff_write")
            else:
                manifest = _dist.on_rank_zero(lambda: self._publish(cpu, first), "writing the first handoff")
                _note_size(record, manifest)
            record.target = self.target
            record.fingerprint = fingerprint
            self.report.enter_wrote = True
        self._footprint = _zero.take_footprint(self.module)
        self._entry = tensors
        self._entry_fingerprint = fingerprint
        if self.training and not on_meta and not self.meta:
            self._host = self._prepare_host(tensors, record)
        if on_meta:  # feed the engine from the handoff one shard, one submodule at a time
            source_target = record.target
            reader = HandoffReader(source_target.uri, storage_options=source_target.storage_options)
            materialize = self._materialize
            _dist.all_ranks(lambda: materialize(reader), f"building the engine's partitions from {source_target.uri}")
            self._entry = reader
        self.report.enter_seconds = time.perf_counter() - start

    def engine_built(self, *, training: bool) -> None:
        """Give the new engine's optimizer the exact fp32 values instead of ones rebuilt from 16-bit weights."""
        if training and self._entry is not None:
            entry = self._entry
            _dist.all_ranks(lambda: _zero.set_fp32_masters(self.module, entry), "loading the fp32 master weights")
            masters = {n for n, p in self.module.named_parameters(remove_duplicate=False) if _zero.has_fp32_master(p)}
            # The masters now hold the trainable values; keep only what the engine cannot give back exactly.
            self._entry = _Without(self._entry, masters)

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

        ``background``: the stage ended normally. The last write is joined with collectives, and this stage's
        is written in a thread that may outlast the call (joined by the next boundary, :meth:`wait_published`
        or the interpreter's exit). ``False`` after a failed stage, when collectives cannot be trusted: rank 0
        joins the last write alone and this stage's handoff is written before returning.
        """
        start = time.perf_counter()
        mark = _PhaseClock(self.report.phases)
        record = _RECORDS[self.module]
        failure: BaseException | None = None  # raised at the end, once the module is clean again
        values: dict[str, torch.Tensor] | None = None
        rewrite = False  # the last background write failed: write this stage's weights in any case
        if background:
            try:
                _wait_pending(record)  # before the memory it reads from is reused
            except BaseException as exc:  # noqa: BLE001 - the weights are still here: rewritten below
                log.error("stagesafe: the last handoff write failed (%s); this stage writes the handoff again", exc)
                rewrite = True
        else:
            _join_without_collectives(record)
        mark("join_last_write")
        host = self._host.ready() if self._host is not None else None
        mark("host_memory_ready")
        streamed = engine is not None and trained and self.meta
        meta_specs = _zero.full_specs(self.module)[0] if self.meta else {}  # shapes, before the engine goes
        to_meta, published = self.meta, True
        try:
            if streamed:
                try:
                    self._publish_streamed(record, {**metadata, "stage": self.stage})
                    self.report.wrote = True
                except BaseException as exc:  # noqa: BLE001 - nothing may be lost: keep the weights in memory
                    failure, to_meta, published = exc, False, False
                    values = _dist.all_ranks(lambda: self._consolidate(record, None), "consolidating the ZeRO shards")
            elif engine is not None and trained:
                values = _dist.all_ranks(lambda: self._consolidate(record, host), "consolidating the ZeRO shards")
            elif self._loaded is not None:
                values = {
                    n: v.detach().to("cpu", record.original[n][0])
                    for n, v in self._loaded.items()
                    if n in record.original
                }
        except BaseException as exc:  # noqa: BLE001 - the module falls back to the last handoff, then we raise
            failure, values = failure or exc, None
        mark("consolidate")
        if host is not None:  # the module's tensors: plain memory again, once Lightning's teardown is over
            (host.unlock_after_return if background else host.unlock_in_background)(host.existing.values())
            mark("unlock")
        if engine is not None:
            _zero.destroy_engine(engine)
        _zero.strip_deepspeed_state(self.module, self._footprint)
        mark("destroy")
        if values is not None and published:  # new weights to write (a streamed write has already written)
            self.report.wrote = True
            publish_values, publish_meta = values, {**metadata, "stage": self.stage}
            if background and not to_meta:
                self._publish_in_background(record, publish_values, publish_meta, private=True, host=host)
                host = None  # the writer unlocks its copy when done
            else:
                try:
                    manifest = _dist.on_rank_zero(
                        lambda: self._publish(publish_values, publish_meta), "writing the handoff"
                    )
                    _note_size(record, manifest)
                except BaseException as exc:  # noqa: BLE001 - the module still gets the new weights; then we raise
                    failure, published = failure or exc, False
        elif values is None and not to_meta:
            values = self._unchanged_values(record)
            if rewrite:
                unchanged, meta_info = values, {**metadata, "stage": self.stage}
                try:
                    manifest = _dist.on_rank_zero(lambda: self._publish(unchanged, meta_info), "writing the handoff")
                    _note_size(record, manifest)
                    self.report.wrote = True
                except BaseException as exc:  # noqa: BLE001 - the module keeps its weights; then we raise
                    failure, published = failure or exc, False
        self._gathered = None  # not written in the background: let the kept masters go
        if host is not None:
            host.unlock()
        if to_meta:
            values = {
                name: torch.empty(shape, dtype=record.original[name][0], device="meta")
                for name, (shape, _) in meta_specs.items()
                if name in record.original
            }
        mark("publish")
        if to_meta:
            self._meta_values = values  # placed by place_meta(), once Lightning's teardown has moved the module
        else:
            self._restore(values, record)
        if not published or record.rewrite_next:
            record.fingerprint = None  # the handoff may not hold these weights: the next stage rewrites it
            record.rewrite_next = False
        mark("restore")
        self.report.handoff_bytes = record.handoff_bytes
        self.report.stale_problems = _zero.find_stale_state(self.module)
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
        assign_values(self.module, values)
        record = _RECORDS[self.module]
        if self.report.wrote:  # otherwise the weights are still where the stage read them from
            record.target = self.target
        record.fingerprint = _fingerprint(_state_tensors(self.module))
        self.report.stale_problems = _zero.find_stale_state(self.module)

    @staticmethod
    def call_returned() -> None:
        """The Trainer call is returning, Lightning's teardown is over: unlock the module's page-locked memory
        now, which would have stalled the teardown's CUDA calls."""
        start_deferred_unlocks()

    @staticmethod
    def wait_for_module(module: nn.Module) -> None:
        """Join the module's background write, if one is running (a collective: every rank calls it)."""
        record = _RECORDS.get(module)
        if record is not None:
            _wait_pending(record)

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

    def _to_original(self, record: _ModuleRecord) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """Cast an engine value to the module's original dtype; an unchanged 16-bit value gives back the exact
        value the stage started from, not a round trip through 16 bits."""
        entry = self._entry or {}

        def to_original(name: str, value: torch.Tensor) -> torch.Tensor:
            dtype = record.original.get(name, (value.dtype, None))[0]
            if value.dtype != dtype:
                before = entry.get(name)
                if before is not None and _bitwise_equal(before.to("cpu", value.dtype), value):
                    return before.to("cpu")
            return value.to(dtype)

        return to_original

    def _publish_streamed(self, record: _ModuleRecord, metadata: Mapping[str, Any]) -> None:
        """Gather and write one tensor at a time (rank 0 writes, every rank joins each gather), so host memory
        stays near one tensor; used when the module lives on the meta device between stages."""
        specs, aliases = _zero.full_specs(self.module)
        specs = {
            n: {"dtype": str(record.original[n][0]).replace("torch.", ""), "shape": list(shape)}
            for n, (shape, _) in specs.items()
            if n in record.original
        }
        gathered = _zero.GatheredValues(self.module, self._to_original(record))
        order = [n for n in specs if n not in aliases]
        asked: list[str] = []

        class _Counting(Mapping):
            def __getitem__(self, name: str) -> torch.Tensor:
                asked.append(name)
                return gathered[name]

            def __iter__(self):
                return iter(order)

            def __len__(self) -> int:
                return len(order)

        def write() -> None:
            if _dist.rank() == 0:
                try:
                    manifest = save_streamed(
                        specs,
                        aliases,
                        _Counting(),
                        self.target.uri,
                        max_shard_size=self.target.max_shard_size,
                        metadata=metadata,
                        storage_options=self.target.storage_options,
                    )
                    _note_size(record, manifest)
                finally:
                    for name in order[len(asked) :]:  # a failed write still joins the gathers the others wait in
                        gathered[name]
            else:
                for name in order:
                    gathered[name]

        _dist.all_ranks(write, "gathering and writing the handoff")

    def _consolidate(self, record: _ModuleRecord, host: HostBuffers | None) -> dict[str, torch.Tensor]:
        """The trained weights: fp32 masters where the engine has them, exact entry values where unchanged.

        With ``host``, masters are copied into the module's own (page-locked) tensors instead of fresh memory;
        those of the shards this rank writes stay gathered for the writer's private copy (``host.fresh``).
        """
        specs, aliases = _zero.full_specs(self.module)
        gathered = _zero.GatheredValues(
            self.module,
            self._to_original(record),
            into=host.existing if host is not None else None,
            also_into=host.fresh if host is not None else None,
        )
        values: dict[str, torch.Tensor] = {}
        for name in specs:  # the same order on every rank: each lookup is a collective
            values[name] = values[aliases[name]] if name in aliases else gathered[name]  # tied: one tensor
        gathered.synchronize()
        self._gathered = gathered
        return {n: values[n] for n in record.original if n in values}

    def _prepare_host(self, tensors: Mapping[str, torch.Tensor], record: _ModuleRecord) -> HostBuffers | None:
        """Host memory for a training stage's end, made ready while it runs: the module's own fp32 CPU tensors
        (which this boundary keeps alive anyway) take the masters in place, and each rank that writes in the
        background gets private buffers for its shards, which later changes to the module cannot reach."""
        trainable = {n for n, p in self.module.named_parameters() if p.requires_grad}  # tied: first name only
        into = {
            n: t
            for n, t in tensors.items()
            if n in trainable
            and t.device.type == "cpu"
            and t.dtype == torch.float32
            and record.original[n][0] == torch.float32
        }
        if not into:
            return None
        written_here = self._names_this_rank_writes(tensors)
        private = {n: (t.shape, t.dtype) for n, t in into.items() if n in written_here}
        lock_on = self.device if self.device is not None and self.device.type == "cuda" else None
        return HostBuffers(into, private, lock_on=lock_on)

    def _names_this_rank_writes(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """The names whose shards this rank will write in the background, planned once per boundary (which
        shard a tensor lands in depends on names and sizes only, the same at the stage's start and end)."""
        if self._written_here is None:
            if not self.background:
                self._written_here = set()
            elif not self._every_rank:
                self._written_here = set(tensors) if _dist.rank() == 0 else set()
            else:
                self._written_here = names_written_by(
                    tensors, max_shard_size=self.target.max_shard_size, rank=_dist.rank(), world=_dist.world_size()
                )
        return self._written_here

    def _private_copies(
        self, values: Mapping[str, torch.Tensor], copied: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """What a background writer reads: the ``copied`` tensors (private copies the writer fills from the
        gathered masters before it writes), clones of the rest, made now, while the job waits."""
        by_id: dict[int, torch.Tensor] = {}
        private = {}
        for name, value in values.items():
            if id(value) not in by_id:  # tied names share one tensor, and one copy
                if name in copied:
                    by_id[id(value)] = copied[name]
                else:
                    by_id[id(value)] = value.clone()
                    self.report.copied_while_waiting += value.nbytes
            private[name] = by_id[id(value)]
        return private

    def _publish_in_background(
        self,
        record: _ModuleRecord,
        values: Mapping[str, torch.Tensor],
        metadata: Mapping[str, Any],
        *,
        private: bool = False,
        host: HostBuffers | None = None,
        phase: str = "handoff_write",
    ) -> None:
        """Write ``values`` in the background, by rank 0 alone or by every rank (a share each). ``private``: the
        write may outlast the Trainer call, so it reads copies the user cannot change (only of the shards this
        rank writes). ``host`` is unlocked once the write is done."""
        target, rank, world = self.target, _dist.rank(), _dist.world_size()
        gathered, self._gathered = (self._gathered if private else None), None
        if private:
            mine = self._names_this_rank_writes(values)
            copied = gathered.copied if gathered is not None else {}
            values = {**values, **self._private_copies({n: values[n] for n in mine}, copied)}
        handoff_metadata = self._handoff_metadata(metadata)

        def write(key: str) -> dict | None:
            start = time.perf_counter()
            manifest = None
            try:
                if gathered is not None:
                    gathered.fill_copies()  # the private copies, made here rather than while the job waited
                    self.report.phases[f"{phase}_private_copy"] = time.perf_counter() - start
                if not self._every_rank:
                    manifest = self._write(values, handoff_metadata, remove_stale_files=False)
                else:
                    manifest = write_share(
                        values, target.uri, target.storage_options, max_shard_size=target.max_shard_size,
                        rank=rank, world=world, key=key, store=_inflight.job_store(), metadata=handoff_metadata,
                        remove_stale_files=False,
                    )
                return manifest
            finally:
                self.report.phases[phase] = time.perf_counter() - start  # durable; perhaps after the call returned
                if manifest is not None:  # rank 0, committed: now the replaced handoff's files may go
                    removing = time.perf_counter()
                    remove_stale(target.uri, manifest, storage_options=target.storage_options)
                    self.report.phases[f"{phase}_remove_replaced"] = time.perf_counter() - removing
                if host is not None:
                    unlocking = time.perf_counter()
                    host.unlock()
                    self.report.phases[f"{phase}_unlock"] = time.perf_counter() - unlocking

        _start_in_background(record, target, write, every_rank=self._every_rank)

    def _unchanged_values(self, record: _ModuleRecord) -> dict[str, torch.Tensor]:
        """After a stage that changed nothing: the entry tensors if untouched, else the handoff itself."""
        entry, before = self._entry, self._entry_fingerprint or {}
        untouched = entry is not None and _fingerprint(entry) == {n: before.get(n) for n in entry}
        if untouched and set(entry) == set(record.original):
            return entry
        return load_state_dict(self.target.uri, storage_options=self.target.storage_options)

    def _publish(
        self, values: Mapping[str, torch.Tensor], metadata: Mapping[str, Any], *, phase: str = "handoff_write"
    ) -> dict:
        start = time.perf_counter()
        try:
            return self._write(values, self._handoff_metadata(metadata))
        finally:
            self.report.phases[phase] = time.perf_counter() - start  # on rank 0, perhaps in a thread

    def _handoff_metadata(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        dtypes = {
            n: str(record_dtype).replace("torch.", "")
            for n, (record_dtype, _) in _RECORDS[self.module].original.items()
        }
        return {**metadata, "original_dtypes": dtypes}

    def _write(
        self, values: Mapping[str, torch.Tensor], metadata: Mapping[str, Any], *, remove_stale_files: bool = True
    ) -> dict:
        """Rank 0 writes the whole handoff; ``metadata`` as :meth:`_handoff_metadata` makes it."""
        return save_state_dict(
            values,
            self.target.uri,
            max_shard_size=self.target.max_shard_size,
            metadata=metadata,
            storage_options=self.target.storage_options,
            remove_stale_files=remove_stale_files,
        )

    def _restore(self, values: Mapping[str, torch.Tensor], record: _ModuleRecord) -> None:
        """Give the module plain tensors holding ``values``, in its original dtype and device."""
        placed = {}
        for name, value in values.items():
            dtype, device = record.original.get(name, (value.dtype, value.device))
            placed[name] = value.to(device="cpu" if device.type == "meta" else device, dtype=dtype)
        assign_values(self.module, placed)
        record.target = self.target
        record.fingerprint = _fingerprint(_state_tensors(self.module))
