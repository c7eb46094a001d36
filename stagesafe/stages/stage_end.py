"""One stage's end, planned when the stage starts and owned by one object: the handoff's plan, the host memory
the end copies into, the optimizer state it keeps, and the device work left for after the call.

At the stage's entry :class:`StageEnd` plans the handoff the end will write, once, from the dtypes the handoff
holds (the fp32 master of every parameter the engine trains in 16 bits), and which of its shards this rank
writes. Once the engine is built it asks whether the host can give what the end will add
(:mod:`~stagesafe.stages.host_budget`, every rank, before any step), then makes that memory ready while the
stage runs: the module's own tensors, which take the trained fp32 weights in place (on a GPU, page-locked;
the C allocator's are first moved one at a time into pages of their own, which can be); this rank's private
copies of the shards it writes (a background write reads them while the user may change the module); and
room for the optimizer state the end keeps, taking over the last fit's kept state once this fit's first step
has made it stale, so that no call holds two.

Host bytes per parameter beyond the module, N ranks, AdamW: the private copies 4/N (until the write is done),
the kept moments 8/N (the kept fp32 masters are the module's own values: :mod:`stagesafe.zero.engine.fp32_partitions`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from stagesafe.handoff.plan import HandoffPlan, dtype_name, plan_specs
from stagesafe.handoff.tensor_plan import plan_handoff
from stagesafe.stages import collectives, host_budget, page_lock
from stagesafe.stages.history import KeptTraining, ModuleHistory
from stagesafe.stages.host import HostBuffers, HostPool, give_back_freed_memory
from stagesafe.stages.shared_write import names_written_by
from stagesafe.zero import engine as zero_engine

__all__ = ["StageEnd", "handoff_specs"]

log = logging.getLogger(__name__)

Original = Mapping[str, tuple[torch.dtype, torch.device]]  # per state-dict name: dtype and device before stage 1
Specs = list[tuple[torch.Size, torch.dtype]]
SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def handoff_specs(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], *, original: Original, built: set[str], masters: set[str]
) -> tuple[dict[str, dict], dict[str, str]]:
    """Name -> ``{"dtype", "shape"}`` of what a stage's end will hand off (full shapes, the parameters zero.Init
    ``built`` included; fp32 for the names in ``masters``, whose fp32 masters the handoff holds, the original
    dtype for the rest), and the tied names."""
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
        dtype = torch.float32 if name in masters else original[name][0]
        specs[name] = {"dtype": dtype_name(dtype), "shape": list(shape)}
    return specs, aliases


class StageEnd:
    """What one Trainer call's end writes, copies into and keeps; made at the call's entry.

    ``device``: the stage's device (host memory is page-locked for a CUDA device only). ``training``: the end
    takes trained weights from the engine. ``keep_optimizer_state``: it keeps the optimizer state too.
    ``writers``: how many ranks write shares of the handoff. ``check_memory``: whether a training stage asks
    the host for its end's memory before its first step. ``module_holds_weights``: False where the module holds
    meta tensors between stages: the kept fp32 master partitions are then kept as they are, not as recipes.
    """

    def __init__(
        self,
        *,
        device: torch.device | None,
        max_shard_size: int,
        writers: int,
        training: bool,
        keep_optimizer_state: bool,
        exclude_frozen: bool,
        stage: str,
        check_memory: bool = True,
        module_holds_weights: bool = True,
    ) -> None:
        self.max_shard_size = max_shard_size  # bytes, parsed once by the strategy
        self._lock_on = device if device is not None and device.type == "cuda" else None
        self._writers = writers
        self._training = training
        self._keep = keep_optimizer_state
        self._pool_on_host = training and keep_optimizer_state and self._lock_on is not None
        self._exclude_frozen = exclude_frozen
        self._stage = stage
        self._check_memory = check_memory
        self._module_holds_weights = module_holds_weights
        self.plan: HandoffPlan | None = None
        self.written_here: set[str] | None = None  # the names whose shards this rank writes
        self.private_names: set[str] = set()  # of those, the ones the module holds: the writer's private copies
        self.weights: HostBuffers | None = None  # the module's own tensors, swapped into own pages where needed
        self._made: HostBuffers | None = None  # new module tensors (zero.Init's) and masters of 16-bit ones
        self._private: HostBuffers | None = None  # private copies of the shards this rank writes (GPU)
        self._waiting: dict[str, Any] = {}  # what engine_built makes once the budget allows it
        self._kept_state: HostPool | None = None
        self._stepped = False
        self._names: dict[int, str] = {}  # id of a parameter -> its name: the kept fp32 partitions' recipes
        self._previous: list[torch.Tensor] = []  # the last fit's kept state's host tensors, for this fit's pool

    # -- the plan ---------------------------------------------------------------------------------------------
    def plan_for(
        self, module: nn.Module, tensors: Mapping[str, torch.Tensor], *, original: Original, built: set[str],
        kept: set[str] = frozenset(),
    ) -> HandoffPlan:
        """Plan the handoff of the module's ``tensors`` as the end will hand them off (fp32 masters of the
        parameters a training stage trains in 16 bits, and of those whose masters are ``kept``), and which of its
        names this rank writes (:attr:`written_here`)."""
        masters = set(kept)
        if self._training:
            masters |= {n for n, p in module.named_parameters(remove_duplicate=False)
                        if p.requires_grad and n in original and original[n][0] in SIXTEEN_BITS}
        specs, aliases = handoff_specs(module, tensors, original=original, built=built, masters=masters)
        self.plan = plan_specs(specs, aliases, max_shard_size=self.max_shard_size)
        self.written_here = names_written_by(self.plan, rank=collectives.rank(), writers=self._writers)
        return self.plan

    def plan_matching(self, values: Mapping[str, torch.Tensor]) -> HandoffPlan:
        """The plan for ``values``: the one made at entry, which holds their names, dtypes and shapes (a stage
        whose end took its weights from elsewhere than planned gets a plan of its own, said in the log)."""
        plan = self.plan
        if plan is not None and _matches(plan, values):
            return plan
        if plan is not None:
            log.debug("stagesafe: the end of %s hands off other dtypes or names than planned; planned again",
                      self._stage)
        fresh = plan_handoff(values, max_shard_size=self.max_shard_size)
        self.plan = plan_specs(fresh.tensors, fresh.aliases, max_shard_size=self.max_shard_size)
        self.written_here = names_written_by(self.plan, rank=collectives.rank(), writers=self._writers)
        return self.plan

    # -- the weights' host memory -----------------------------------------------------------------------------
    def prepare_weights(
        self,
        module: nn.Module,
        entry: dict[str, torch.Tensor],
        history: ModuleHistory,
        *,
        built: set[str],
        masters: Mapping[str, torch.Tensor],
    ) -> None:
        """Start making the module's own tensors ready for a training stage's end: its fp32 CPU tensors (the
        stage's ``entry``) take the masters in place (on a GPU, those of the C allocator are first moved into
        pages of their own, one at a time, each put in its place in ``entry`` and in what ``history`` knows of
        it); so do the kept fp32 ``masters`` of parameters it holds in 16 bits. What the end needs new
        (zero.Init's parameters, masters not kept yet) and this rank's private copies are made once the budget
        allows (:meth:`engine_built`)."""
        assert self.plan is not None and self.written_here is not None, "plan_for() first"
        original = history.original

        def replace(name: str, old: torch.Tensor, new: torch.Tensor) -> None:  # in the moving thread
            if entry.get(name) is old:
                entry[name] = new
            history.moved_tensor(name, old, new)

        trainable = {n for n, p in module.named_parameters() if p.requires_grad}  # tied: first name only
        fp32 = {n for n in trainable if original[n][0] == torch.float32}
        sixteen = {n for n in trainable if original[n][0] in SIXTEEN_BITS}
        into = {n: entry[n] for n in fp32 - built if _host_fp32(entry.get(n))}
        into.update({n: m for n, m in masters.items() if n in sixteen and _host_fp32(m)})
        swap = {}
        if self._lock_on is not None:  # the C allocator's pages may hold other allocations: never locked
            swap = {n: t for n, t in into.items() if n in fp32 and not page_lock.lockable(t) and t.is_contiguous()}
            into = {n: t for n, t in into.items() if n not in swap}
        specs = self.plan.tensors
        new = {n: (torch.Size(specs[n]["shape"]), torch.float32) for n in ((fp32 & built) | sixteen) - set(into)}
        self.private_names = {n for n in {*into, *swap, *new} if n in self.written_here and n not in sixteen}
        private = {n: (torch.Size(specs[n]["shape"]), torch.float32) for n in self.private_names}
        self._waiting = {"new": new, "private": private if self._lock_on is not None else {}, "swap": swap}
        if into or swap:
            self.weights = HostBuffers(into, {}, swap=swap, replace=replace, lock_on=self._lock_on)

    def weights_ready(self) -> dict[str, torch.Tensor] | None:
        """The host tensors the trained weights go into, by name, once ready (None where none were prepared).
        A stage that ends before every tensor was moved into pages of its own copies into the rest as they are."""
        parts = [b.stop() for b in (self.weights, self._made) if b is not None]
        if not parts:
            return None
        return {name: t for part in parts for name, t in part.existing.items()}

    def private_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's private copies' host memory, once ready, handed over: the caller's references are the
        only ones, so the memory goes when the write lets go of it (empty on the CPU, where the gathered masters
        are the private copies)."""
        if self._private is None:
            return {}
        buffers, self._private.fresh = self._private.ready().fresh, {}
        return buffers

    def unlock(self) -> None:
        """Unlock the module's tensors locked for the end (the call has returned)."""
        for buffers in (self.weights, self._made):
            if buffers is not None:
                buffers.unlock()

    def after_call(self) -> None:
        """Once the call has returned (a writer's device thread): unlock, and give the memory the engine freed
        back to the kernel."""
        self.unlock()
        if self._training and self._lock_on is None:  # an engine on the CPU freed its state into the C heap
            give_back_freed_memory()

    # -- the last fit's kept state, and once the engine is built --------------------------------------------------
    def take_over_kept_state(self, history: ModuleHistory | None) -> None:
        """A training stage's entry, before its engine is built: the last fit's kept optimizer state goes (this
        fit's engine makes its own, and its first step would make that one stale); on a GPU its host memory is
        kept for this fit's own (:meth:`engine_built`), on the CPU it is freed before the engine allocates."""
        if self._training:
            released = _release_kept_state(history)
            self._previous = released if self._pool_on_host else []

    def engine_built(self, engine: Any, module: nn.Module, last_write: Any = None) -> None:
        """Before the first step: ask the host for what the end adds (a collective; every rank raises
        :class:`~stagesafe.errors.HostMemoryError` on a shortfall), then start making it ready. ``last_write``:
        the writer whose last write may still hold its private copies (``held_bytes()``); this stage's are
        made once it has let them go (``wait_let_go()``), so that no rank holds two sets."""
        if not self._training:
            return
        if self._module_holds_weights:  # its values are the kept fp32 partitions' source
            self._names = {id(p): n for n, p in module.named_parameters()}
        previous, self._previous = self._previous, []
        state = self._state_specs(engine) if self._pool_on_host else []
        held = last_write.held_bytes() if last_write is not None else 0
        if self._check_memory:
            host_budget.check(self._needs(state, previous, released=held), stage=self._stage)
        waiting, self._waiting = self._waiting, {}
        after = last_write.wait_let_go if held and last_write is not None else None
        if waiting.get("new"):
            self._made = HostBuffers({}, {}, new=waiting["new"], lock_on=self._lock_on, after=after)
        if waiting.get("private"):
            self._private = HostBuffers({}, waiting["private"], lock_on=self._lock_on, after=after)
        if self._pool_on_host:
            self._kept_state = HostPool([], lock_on=self._lock_on)
            self._kept_state.adopt(previous)
            self._kept_state.add(state)

    def optimizer_stepped(self, engine: Any) -> None:
        """After an optimizer step (local, cheap once done): the first time the engine has stepped, the state
        the optimizer made is sized, and host memory for what was not foreseen is made ready too."""
        if self._stepped or not self._pool_on_host or getattr(engine, "global_steps", 0) < 1:
            return
        self._stepped = True
        self._size(lambda: self._device_specs(engine))

    def _state_specs(self, engine: Any) -> Specs:
        """The optimizer state the end will copy off the device: what it holds now, and what its first step
        will make, as far as its kind says."""
        try:
            return [*self._device_specs(engine), *zero_engine.foreseen_state_specs(engine)]
        except Exception as exc:  # noqa: BLE001 - only the budget's estimate and the end's speed are at stake
            log.warning("stagesafe: could not size the optimizer state kept at the end of %s: %s", self._stage, exc)
            return []

    def _device_specs(self, engine: Any) -> Specs:
        specs = zero_engine.checkpoint_device_specs(engine, exclude_frozen=self._exclude_frozen, names=self._names)
        return specs or []

    def _needs(self, state: Specs, previous: list[torch.Tensor], *, released: int = 0) -> host_budget.Needs:
        """What the end adds to this rank's host memory, by what it is for (on the CPU the private copies are
        the gathered masters themselves, made at the end: the same bytes)."""
        waiting = self._waiting
        specs = self.plan.tensors if self.plan is not None else {}
        private = sum(_spec_nbytes(specs[n]) for n in self.private_names if n in specs)
        return host_budget.Needs(
            private_copies=private,
            kept_state=max(0, sum(_nbytes(s) for s in state) - sum(t.nbytes for t in previous)),
            new_tensors=sum(_nbytes(s) for s in waiting.get("new", {}).values()),
            moving=max((t.nbytes for t in waiting.get("swap", {}).values()), default=0),
            released=released,
        )

    # -- the optimizer state kept beyond the engine ---------------------------------------------------------
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
            engine, exclude_frozen=self._exclude_frozen, host_memory=pool.take if pool is not None else None,
            names=self._names,
        ), None))
        return files, missing

    def keep_engine_state_later(
        self, engine: Any
    ) -> tuple[dict[str, dict[str, Any]] | None, str, zero_engine.LaterCopies | None]:
        """:meth:`keep_engine_state`, but the tensors on the engine's device stay in the files as they are until
        :meth:`kept_state_copy` copies them, after the engine is destroyed and the Trainer call has returned:
        the call does not wait for the pool nor for the copy."""
        return self._engine_files(lambda: zero_engine.checkpoint_files_later(
            engine, exclude_frozen=self._exclude_frozen, names=self._names))

    def kept_state_copy(self, later: zero_engine.LaterCopies, history: ModuleHistory) -> Callable[[], None]:
        """The kept state's copy off the device into the pool (once it is ready), for the writer's device
        thread, which every collective and the next call's entry wait for; a failure leaves the module without
        kept state (``history.kept``), and says why when a checkpoint is saved."""
        files = history.kept.checkpoint if history.kept is not None else None
        copied = history.kept.copied if history.kept is not None else None
        shared = history.kept.shared if history.kept is not None else None

        def copy_kept() -> None:
            pool = self._kept_state
            try:
                later.finish(pool.ready().take if pool is not None else None)
            except Exception as exc:  # noqa: BLE001 - the weights are safe; a checkpoint saved later says this
                log.warning("stagesafe: could not copy the optimizer state kept at the end of %s: %s", self._stage, exc)
                kept = history.kept
                if kept is not None and files is not None and kept.checkpoint is files:
                    kept.drop(f"copying it off the device failed ({type(exc).__name__})")
                if shared is not None:
                    shared.give_up()
            else:
                if shared is not None and files is not None:
                    _share(shared, files, self._stage)
            finally:
                self.release_kept_state()
                if copied is not None:
                    copied.set()

        return copy_kept

    def release_kept_state(self) -> None:
        """The pool is done with: what was not taken goes (unlocked as it is freed)."""
        pool, self._kept_state = self._kept_state, None
        if pool is not None:
            pool.close()

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


def _share(shared: Any, files: dict[str, dict[str, Any]], stage: str) -> None:
    """This rank's part of the state the host's ranks share; the files stay as they were where it fails."""
    try:
        shared.fill(files)
    except Exception as exc:  # noqa: BLE001 - the kept state stays whole in the files; only the views go
        log.warning("stagesafe: could not share the optimizer state kept at the end of %s between the ranks of "
                    "this host: %s; trainer.optimizers[0].state stays empty", stage, exc)


def _matches(plan: HandoffPlan, values: Mapping[str, torch.Tensor]) -> bool:
    if set(plan.tensors) != set(values):
        return False
    return all(
        spec["dtype"] == dtype_name(values[name].dtype) and list(spec["shape"]) == list(values[name].shape)
        for name, spec in plan.tensors.items()
    )


def _kept_tensors(history: ModuleHistory | None) -> list[torch.Tensor]:
    """The host tensors of the last fit's kept optimizer state (each once)."""
    kept = history.kept if history is not None else None
    if kept is None or kept.checkpoint is None:
        return []
    tensors = {t.untyped_storage().data_ptr(): t for t in zero_engine.tensors_in(kept.checkpoint) if t.numel()}
    return list(tensors.values())


def _release_kept_state(history: ModuleHistory | None) -> list[torch.Tensor]:
    """Let go of the last fit's kept optimizer state (a step has made it stale); its tensors, for a pool."""
    tensors = _kept_tensors(history)
    kept: KeptTraining | None = history.kept if history is not None else None
    if kept is not None and kept.checkpoint is not None:
        kept.drop("the fit after it let it go as it started, and ended without keeping its own")
    elif kept is not None:
        kept.drop_views()
    return tensors


def _host_fp32(tensor: torch.Tensor | None) -> bool:
    return (
        tensor is not None and tensor.device.type == "cpu" and tensor.dtype == torch.float32
        and tensor.is_contiguous() and tensor.numel() > 0
    )


def _nbytes(spec: tuple[torch.Size, torch.dtype]) -> int:
    shape, dtype = spec
    return torch.Size(shape).numel() * dtype.itemsize


def _spec_nbytes(spec: Mapping[str, Any]) -> int:
    return torch.Size(spec["shape"]).numel() * getattr(torch, spec["dtype"]).itemsize
