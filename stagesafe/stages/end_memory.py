"""The host memory one stage's end copies into, chosen and made ready while the stage runs.

A training stage's end copies the trained fp32 weights into the module's own CPU tensors (page-locked during
the stage), gives this rank's background writer private buffers for the shards it writes, and copies the
optimizer state it keeps beyond the engine into a pool sized once the optimizer has made that state.
:mod:`stagesafe.stages.host` holds the mechanism (allocate, touch, page-lock in a thread); this module decides
what one stage prepares, and plans once which names this rank writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from stagesafe.stages import collectives, page_lock
from stagesafe.stages.history import KeptTraining, ModuleHistory
from stagesafe.stages.host import HostBuffers, HostPool
from stagesafe.stages.shared_write import names_written_by
from stagesafe.zero import engine as zero_engine

__all__ = ["EndMemory", "end_specs"]

log = logging.getLogger(__name__)

Original = Mapping[str, tuple[torch.dtype, torch.device]]  # per state-dict name: dtype and device before stage 1
Specs = list[tuple[torch.Size, torch.dtype]]
_SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def end_specs(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], *, original: Original, built: set[str]
) -> tuple[dict[str, dict], dict[str, str]]:
    """Name -> ``{"dtype", "shape"}`` of what a stage's end will hand off (original dtypes, full shapes, the
    parameters zero.Init ``built`` included), and the tied names: what the write will plan its shards from."""
    params = dict(module.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    aliases = {}
    for name, param in params.items():
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    specs = {}
    for name, tensor in tensors.items():
        shape = zero_engine.full_shape(params[name]) if name in built else tensor.shape
        specs[name] = {"dtype": str(original[name][0]).removeprefix("torch."), "shape": list(shape)}
    return specs, aliases


class EndMemory:
    """What one stage's end copies into: ``weights`` (host tensors for the trained weights and the writer's
    private copies) and a pool for the optimizer state it keeps, each made ready in a thread.

    ``device``: the stage's device (host memory is page-locked for a CUDA device only). ``training`` and
    ``keep_optimizer_state``: the end keeps the optimizer state (on a GPU its pool is sized from the live
    engine). ``writers``: how many ranks write shares of the handoff (the writer's).
    """

    def __init__(
        self,
        *,
        device: torch.device | None,
        max_shard_size: int | str,
        writers: int,
        training: bool,
        keep_optimizer_state: bool,
        exclude_frozen: bool,
        stage: str,
    ) -> None:
        self._lock_on = device if device is not None and device.type == "cuda" else None
        self._max_shard_size = max_shard_size
        self._writers = writers
        self._keep = keep_optimizer_state
        self._size_kept_state = training and keep_optimizer_state and self._lock_on is not None
        self._exclude_frozen = exclude_frozen
        self._stage = stage
        self.weights: HostBuffers | None = None
        self._kept_state: HostPool | None = None  # where the end copies the engine's optimizer state
        self._stepped = False  # the optimizer state was sized after the first step
        self.written_here: set[str] | None = None  # the names this rank writes, once planned

    # -- the weights ----------------------------------------------------------------------------------------
    def prepare_weights(
        self, module: nn.Module, tensors: Mapping[str, torch.Tensor], *, original: Original, built: set[str]
    ) -> None:
        """Start making host memory ready for a training stage's weights: the module's own fp32 CPU tensors
        (which the boundary keeps alive anyway) take the masters in place, new ones are made for parameters
        zero.Init ``built`` (whose module tensors are empty placeholders) and, on a GPU, for those that cannot be
        page-locked in place (:func:`~stagesafe.stages.page_lock.lockable`: all but stagesafe's own), and this
        rank gets private buffers for the shards it writes in the background, which later changes to the module
        cannot reach."""
        specs, aliases = end_specs(module, tensors, original=original, built=built)
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}  # tied: first name only
        fp32 = {n for n in trainable if original[n][0] == torch.float32}
        sixteen = {n for n in trainable if original[n][0] in _SIXTEEN_BITS}
        into = {n: tensors[n] for n in fp32 - built if tensors[n].device.type == "cpu"
                and tensors[n].dtype == torch.float32}
        # a tensor of the C allocator may share its pages with other allocations and is never page-locked: one
        # with pages of its own, made here, replaces it. So the module's first training stage on a GPU holds
        # these weights twice; the module then has stagesafe's own pages, locked in place by later stages
        apart = {n for n, t in into.items() if not page_lock.lockable(t)} if self._lock_on is not None else set()
        into = {n: t for n, t in into.items() if n not in apart}
        new = {n: (torch.Size(specs[n]["shape"]), torch.float32) for n in (fp32 & built) | sixteen | apart}
        if not into and not new:
            return
        written_here = self.plan_writes(specs, aliases)
        # a 16-bit parameter's master stays stagesafe's own (the module gets a cast): no private copy needed
        private = {n: (torch.Size(specs[n]["shape"]), torch.float32) for n in [*into, *new]
                   if n in written_here and n not in sixteen}
        self.weights = HostBuffers(into, private, new=new, lock_on=self._lock_on)

    def weights_ready(self) -> HostBuffers | None:
        """The weights' host memory, once ready (None where none was prepared)."""
        return self.weights.ready() if self.weights is not None else None

    def plan_writes(self, specs: Mapping[str, dict], aliases: Mapping[str, str]) -> set[str]:
        """The names whose shards this rank will write in the background, planned once per stage (which
        shard a tensor lands in depends on names and sizes only, the same at the stage's start and end);
        kept as :attr:`written_here`."""
        if self.written_here is None:
            self.written_here = names_written_by(
                specs, aliases, max_shard_size=self._max_shard_size, rank=collectives.rank(), writers=self._writers
            )
        return self.written_here

    # -- the optimizer state kept beyond the engine ---------------------------------------------------------
    def engine_built(self, engine: Any) -> None:
        """Start making host memory ready for the optimizer state the stage's end keeps, as far as it is
        known: what it holds now, and what the optimizer's kind says its first step will make."""
        if not self._size_kept_state:
            return

        def specs() -> Specs:
            now = zero_engine.checkpoint_device_specs(engine, exclude_frozen=self._exclude_frozen) or []
            return [*now, *zero_engine.foreseen_state_specs(engine)]

        self._size(specs)

    def optimizer_stepped(self, engine: Any) -> None:
        """After an optimizer step (local, cheap once done): the first time the engine has stepped, the state
        the optimizer made is sized, and host memory for what was not foreseen is made ready too."""
        if self._stepped or not self._size_kept_state or getattr(engine, "global_steps", 0) < 1:
            return
        self._stepped = True
        self._size(lambda: zero_engine.checkpoint_device_specs(engine, exclude_frozen=self._exclude_frozen) or [])

    def hold_kept_state(self) -> None:
        """Making the kept state's pool ready waits from now until its copy makes it ready (or
        :meth:`release_kept_state_hold`): the end's own copies and CUDA calls come first (:meth:`HostPool.hold`)."""
        if self._kept_state is not None:
            self._kept_state.hold()

    def release_kept_state_hold(self) -> None:
        """End :meth:`hold_kept_state` where no copy will (the end failed before handing it over)."""
        if self._kept_state is not None:
            self._kept_state.release()

    def kept_state_ready(self) -> None:
        if self._kept_state is not None:
            self._kept_state.ready()

    def keep_engine_state(self, engine: Any) -> tuple[dict[str, dict[str, Any]] | None, str]:
        """This rank's files of DeepSpeed's checkpoint now (copied into the pool where it has room), or None
        and why there are none, said when a checkpoint is saved without them."""
        pool = self._kept_state
        files, missing, _ = self._engine_files(lambda: (zero_engine.checkpoint_files(
            engine, exclude_frozen=self._exclude_frozen, host_memory=pool.take if pool is not None else None
        ), None))
        return files, missing

    def keep_engine_state_later(
        self, engine: Any
    ) -> tuple[dict[str, dict[str, Any]] | None, str, zero_engine.LaterCopies | None]:
        """:meth:`keep_engine_state`, but the tensors on the engine's device stay in the files as they are until
        :meth:`finish_kept_state` copies them, after the engine is destroyed and the Trainer call has returned:
        the call does not wait for the pool nor for the copy."""
        return self._engine_files(lambda: zero_engine.checkpoint_files_later(engine, exclude_frozen=self._exclude_frozen))

    def finish_kept_state(self, later: zero_engine.LaterCopies, owner: Callable[[], Any]) -> None:
        """Copy what :meth:`keep_engine_state_later` left into the pool (once it is ready), then release the
        pool: the taken tensors stay locked while ``owner()`` (what holds the kept state then) lives."""
        pool = self._kept_state
        try:
            later.finish(pool.ready().take if pool is not None else None)
        finally:
            self.release_kept_state(owner())

    def kept_state_copy(self, later: zero_engine.LaterCopies, history: ModuleHistory) -> Callable[[], None]:
        """The kept state's copy off the device (:meth:`finish_kept_state`), for the writer's device thread,
        which every collective and the next call's entry wait for; a failure leaves the module without kept
        state (``history.kept``), and says why when a checkpoint is saved."""
        files = history.kept.checkpoint if history.kept is not None else None

        def owner() -> KeptTraining | None:
            return history.kept if history.kept is not None and history.kept.checkpoint is not None else None

        def copy_kept() -> None:
            try:
                self.finish_kept_state(later, owner)
            except Exception as exc:  # noqa: BLE001 - the weights are safe; a checkpoint saved later says this
                log.warning("stagesafe: could not copy the optimizer state kept at the end of %s: %s", self._stage, exc)
                kept = history.kept
                if kept is not None and files is not None and kept.checkpoint is files:
                    kept.checkpoint, kept.missing = None, f"copying it off the device failed ({type(exc).__name__})"

        return copy_kept

    def _engine_files(
        self, files_now: Callable[[], tuple[dict[str, dict[str, Any]] | None, Any]]
    ) -> tuple[dict[str, dict[str, Any]] | None, str, Any]:
        if not self._keep:
            return None, "StageSafeDeepSpeedStrategy(keep_optimizer_state=False) keeps none between Trainer calls", None
        try:
            files, later = files_now()
        except Exception as exc:  # noqa: BLE001 - the weights are what must not be lost; this is said at saving
            log.warning("stagesafe: could not keep the optimizer state at the end of %s: %s", self._stage, exc)
            return None, f"keeping it at the end of {self._stage} failed ({type(exc).__name__}: {exc})", None
        if files is None:
            return None, "DeepSpeed holds part of it outside its checkpoint files here (NVMe offload or MoE layers)", None
        return files, "", later

    def release_kept_state(self, owner: Any | None) -> None:
        """The pool is done with: what was not taken is unlocked; the taken tensors stay locked while
        ``owner`` (what holds them) lives."""
        pool, self._kept_state = self._kept_state, None
        if pool is not None:
            pool.close(owner)

    def _size(self, specs_now: Callable[[], Specs]) -> None:
        try:
            specs = specs_now()
        except Exception as exc:  # noqa: BLE001 - only the end's speed is at stake: it allocates then
            log.warning("stagesafe: could not size the optimizer state kept at the end of %s: %s", self._stage, exc)
            return
        if self._kept_state is None and specs:
            self._kept_state = HostPool(specs, lock_on=self._lock_on)
        elif self._kept_state is not None:
            self._kept_state.add(specs)
