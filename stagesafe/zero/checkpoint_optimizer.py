"""A ZeRO checkpoint's optimizer state, read per parameter, whatever number of ranks wrote it.

DeepSpeed keeps each rank's optimizer state beside its flat fp32 partitions: every tensor the optimizer holds per
element of a partition (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``) is laid out as the
partition is, so a parameter's slice of it sits at the same elements as its fp32 master, which
:mod:`.checkpoint_tensors` found already. :class:`CheckpointOptimizer` describes that state from the pickles'
structure (nothing read, nothing run): the keys held per element, those held once per group (``step``), the param
groups' hyperparameters, the loss scaler and the engine's counters. :meth:`CheckpointOptimizer.read_into` reads
any run of a parameter's elements of a key from whichever ranks hold them, with ``pread``: a rank of another world
size reads only its own share. State that is neither per element nor one value (a tensor of another shape) cannot
be re-partitioned: :class:`~stagesafe.errors.CheckpointFormatError` names it.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stagesafe.errors import CheckpointFormatError, shown
from stagesafe.zero.checkpoint import ZeroCheckpoint, materialized
from stagesafe.zero.checkpoint_tensors import Piece
from stagesafe.zero.pickle_globals import OpaqueRecord, TensorRecord
from stagesafe.zero.rank_file import RankFile
from stagesafe.zero.widen import to_float32

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointOptimizer", "GLOBAL_KEYS", "plain_value"]

# What the ZeRO optimizer's own state_dict holds beside the base optimizer's, read from rank 0 (the same on every rank).
GLOBAL_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "ds_version")
_READERS = 8  # threads that read a checkpoint into an engine at once
# What the engine reads of the model states when it loads a checkpoint, beside the module and the frozen fragments.
ENGINE_KEYS = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size", "lr_scheduler")


@dataclass(frozen=True)
class _Held:
    """A key of a group's optimizer state on one rank: ``record`` for a key held per element (flat), else the
    value as the pickle reader built it."""

    kind: str  # "element" (one value per element of the partition), "value" (one value for the group), "other"
    record: TensorRecord | None = None
    value: Any = None
    shape: tuple[int, ...] = ()


class CheckpointOptimizer:
    """The optimizer state of an opened ZeRO checkpoint, per parameter (see the module)."""

    restores_hyperparameters = True  # a resume takes the param groups' values it saved (the lr reached), as stock

    def __init__(self, ckpt: ZeroCheckpoint) -> None:
        described = ckpt.described
        if not described.optimizer_states or not described.partitions:
            raise CheckpointFormatError(f"{ckpt.tag_url!r} holds no optimizer files")
        self._ckpt = ckpt
        self.stage, self.world_size, self.tag_url = ckpt.stage, ckpt.world_size, ckpt.tag_url
        self.specs = ckpt.tensors  #: every stored tensor's name, dtype, shape and kind (param, frozen, buffer)
        self._rank_of: dict[int, tuple[int, int]] = {}  # id of a flat fp32 record -> (rank, group)
        for rank, groups in enumerate(described.partitions):
            for group, (_, record) in enumerate(groups):
                self._rank_of[id(record)] = (rank, group)
        self.groups = len(described.partitions[0])  # flat partitions per rank (ZeRO-3: sub-groups)
        base = [self._base_state(file, osd) for file, osd in described.optimizer_states]
        self._groups_read = base[0][1]  # the param groups as the pickle reader built them, or None (elastic)
        self._held = [  # [rank][group] -> key -> how it is held
            [self._held_of(file, states, rank, g) for g, states in enumerate(base[rank][0])]
            for rank, (file, _) in enumerate(described.optimizer_states)
        ]
        self.element_keys, self.value_keys = self._keys()
        self.element_dtypes = {k: self._held[0][0][k].record.dtype for k in self.element_keys} if self.groups else {}
        self.master_dtype = described.partitions[0][0][1].dtype if self.groups else "float32"
        model0 = described.model_states[0][1]
        self.has_frozen = isinstance(model0.get("frozen_param_fragments"), Mapping)
        self.partition_groups = self._partition_groups(model0)  # per flat partition: its param group
        self.group_of = self._group_of_params(model0)

    # -- description (torch is imported by what gives values as torch.load does) ---------------------------------
    @functools.cached_property
    def param_groups(self) -> list[dict[str, Any]] | None:
        """Hyperparameters per param group, as ``torch.load`` gives them, or None (ZeRO 1/2's elastic form)."""
        if self._groups_read is None:
            return None
        file = self._ckpt.described.optimizer_states[0][0]
        return [dict(materialized(file, g).items()) for g in self._groups_read]

    @functools.cached_property
    def global_state(self) -> dict[str, Any]:
        """What the ZeRO optimizer's own state dict holds beside the base optimizer's (:data:`GLOBAL_KEYS`), as
        ``torch.load`` gives it."""
        file0, osd0 = self._ckpt.described.optimizer_states[0]
        out = {k: materialized(file0, osd0[k]) for k in GLOBAL_KEYS if k in osd0}
        if "ds_version" not in out and self._ckpt.ds_version is not None:
            out["ds_version"] = self._ckpt.ds_version
        return out

    def values(self, group: int) -> dict[str, Any]:
        """The keys of flat partition ``group``'s state held as one value (``step``), as ``torch.load`` gives them
        (rank 0's)."""
        file = self._ckpt.described.optimizer_states[0][0]
        return {k: materialized(file, self._held[0][group][k].value) for k in self.value_keys}

    def partition_of_group(self, group: int) -> int:
        """A flat partition of param group ``group`` (whose one-value state, ``step``, the group's share)."""
        return self.partition_groups.index(group) if group in self.partition_groups else 0

    def param_group_of(self, name: str) -> int:
        """The optimizer param group the trained parameter ``name`` belongs to in the checkpoint."""
        return self.group_of[name]

    def model_states(self) -> dict[str, Any]:
        """What the engine reads of rank 0's model states besides the tensors (its counters, the lr scheduler
        DeepSpeed was given), as ``torch.load`` gives them; and the saved module: buffers, and under ZeRO 1 and
        2 the 16-bit parameters whole (under ZeRO-3 their empty placeholders)."""
        file, states = self._ckpt.described.model_states[0]
        out = {k: materialized(file, states[k]) for k in ENGINE_KEYS if k in states}
        out["module"] = materialized(file, states["module"])
        return out

    def frozen_fragments(self) -> dict[str, Any]:
        """ZeRO 1 and 2: the frozen parameters whole, as rank 0's model states hold them."""
        file, states = self._ckpt.described.model_states[0]
        fragments = states.get("frozen_param_fragments")
        return materialized(file, fragments) if isinstance(fragments, Mapping) else {}

    # -- the same, as plain data (no torch): what the world-size-free form writes as JSON ---------------------------
    def trained(self) -> dict[str, int]:
        """Every trained parameter's name (tied ones once, as DeepSpeed saves them) -> its param group, in the
        checkpoint's order."""
        return {name: group for name, group in self.group_of.items()
                if name in self.specs and self.specs[name].kind == "param"}

    def plain_param_groups(self) -> list[dict[str, Any]] | None:
        """Each param group's hyperparameters as JSON values (``params`` left out), or None (elastic form)."""
        if self._groups_read is None:
            return None
        file = self._ckpt.described.optimizer_states[0][0]
        return [
            {str(k): plain_value(file, v, f"hyperparameter {k!r} of param group {i}") for k, v in g.items()
             if k != "params"}
            for i, g in enumerate(self._groups_read)
        ]

    def plain_values(self, group: int) -> dict[str, Any]:
        """:meth:`values` of flat partition ``group`` as JSON: a tensor as ``{"dtype", "value"}``, else the value."""
        file = self._ckpt.described.optimizer_states[0][0]
        out = {}
        for key in self.value_keys:
            value = self._held[0][group][key].value
            what = f"optimizer state {key!r} of partition {group}"
            out[key] = ({"dtype": value.dtype, "value": plain_value(file, value, what)}
                        if isinstance(value, TensorRecord) else {"value": plain_value(file, value, what)})
        return out

    def plain_loss_scaler(self) -> dict[str, Any] | None:
        """The loss scaler's class name and its plain attributes (scale, iteration counts), or None."""
        saved = self._ckpt.described.optimizer_states[0][1].get("loss_scaler")
        if not isinstance(saved, OpaqueRecord):
            return None
        attributes = {str(k): v for k, v in saved._attributes.items() if type(v) in (int, float, bool)}
        return {"class": saved._stands_for, "attributes": attributes}

    def element_pieces(self, name: str, key: str) -> tuple[Piece, ...]:
        """The runs of the rank files that hold the trained parameter ``name``'s state ``key``, in order: where its
        fp32 master lies, in the key's own tensor."""
        return tuple(piece._replace(tensor=self._element_record(piece.tensor, key, name))
                     for piece in self._ckpt.sources(name))

    # -- reading -------------------------------------------------------------------------------------------------
    def read_into(self, name: str, key: str | None, first: int, out: "torch.Tensor") -> None:
        """Elements ``[first, first + out.numel())`` of the flattened parameter ``name``'s state ``key`` (None: its
        fp32 master; a frozen parameter's value) into the contiguous 1-D tensor ``out``, of the key's dtype."""
        import torch

        need, done, skip = out.numel(), 0, first
        if need == 0:
            return
        itemsize = out.element_size()
        into = memoryview(out.view(torch.uint8).numpy())
        for piece in self._ckpt.sources(name):
            if skip >= piece.length:
                skip -= piece.length
                continue
            take = min(piece.length - skip, need - done)
            record = piece.tensor if key is None else self._element_record(piece.tensor, key, name)
            if record.itemsize != itemsize:
                raise CheckpointFormatError(
                    f"{self.tag_url!r}: {key or 'the master'} of {shown(name)} is {record.dtype}"
                )
            piece.file.read_into(record, piece.start + skip, into[done * itemsize : (done + take) * itemsize])
            done, skip = done + take, 0
            if done == need:
                return
        raise CheckpointFormatError(
            f"{self.tag_url!r}: {shown(name)} holds fewer than the {first + need} elements asked for"
        )

    def read_all(self, reads: list[tuple[str, str | None, int, torch.Tensor]]) -> None:
        """Each ``(name, key, first, out)`` of :meth:`read_into`, largest first, on a few threads (``pread`` lets
        go of the GIL; a first touch of fresh memory costs a page fault, which one thread pays slowly)."""
        from stagesafe.storage.workers import Workers

        reads = sorted(reads, key=lambda r: -r[3].numel())
        threads = max(1, min(_READERS, os.cpu_count() or 1, len(reads)))
        if threads == 1:
            for read in reads:
                self.read_into(*read)
            return
        with Workers(threads, name="stagesafe-resume-read") as pool:
            list(pool.map(lambda read: self.read_into(*read), reads))

    # -- internals -----------------------------------------------------------------------------------------------
    def _element_record(self, fp32: TensorRecord, key: str, name: str) -> TensorRecord:
        where = self._rank_of.get(id(fp32))
        if where is None:  # a frozen parameter's fragment: no optimizer state
            raise CheckpointFormatError(f"{self.tag_url!r}: {shown(name)} is not trained: it has no {key!r}")
        rank, group = where
        return self._held[rank][group][key].record

    def _base_state(self, file: RankFile, osd: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], Any]:
        """A rank's base optimizer state: its per-group state dicts, in flat-partition order, and its
        ``param_groups`` (None for ZeRO 1/2's elastic form, which keeps only the states and the step)."""
        key = "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"
        base = osd.get(key)
        if isinstance(base, (list, tuple)) and self.stage < 3:  # elastic: one lean state dict per group
            step = osd.get("base_optimizer_state_step")
            states = [self._mapping(file, s, f"{key}[{i}]") for i, s in enumerate(base)]
            if step is not None:
                states = [{**s, "step": step} for s in states]
            return states, None
        base = self._mapping(file, base, key)
        state = self._mapping(file, base.get("state", {}), f"{key}['state']")
        groups = base.get("param_groups")
        if not isinstance(groups, (list, tuple)):
            raise self._bad(file, f"{key} has no param_groups list")
        indices = [i for g in groups for i in self._mapping(file, g, "a param group").get("params", ())]
        if indices != list(range(len(indices))) or len(indices) != self.groups:
            raise self._bad(
                file, f"its optimizer lists params {shown(indices, 80)} for {self.groups} flat partitions, not one "
                "per partition in order"
            )
        return [self._mapping(file, state.get(i, {}), f"state {i}") for i in range(self.groups)], groups

    def _held_of(self, file: RankFile, states: Mapping[str, Any], rank: int, group: int) -> dict[str, _Held]:
        fp32 = self._ckpt.described.partitions[rank][group][1]
        held = {}
        for key, value in states.items():
            if not isinstance(key, str):
                raise self._bad(file, f"optimizer state key {shown(key, 60)} is not a name")
            if isinstance(value, TensorRecord):
                if len(value.shape) == 0:
                    held[key] = _Held("value", value=value)
                elif len(value.shape) == 1 and value.numel >= fp32.numel:
                    record = file.check(value, f"optimizer state {key!r} of group {group}").flat()
                    held[key] = _Held("element", record=record)
                else:
                    held[key] = _Held("other", shape=tuple(value.shape))
            elif value is None or type(value) in (int, float, bool):
                held[key] = _Held("value", value=value)
            else:
                held[key] = _Held("other", value=value)
        return held

    def _keys(self) -> tuple[list[str], list[str]]:
        """The keys held per element and per group, the same on every rank and partition; others are refused."""
        first = self._held[0][0] if self.groups else {}
        for rank, groups in enumerate(self._held):
            for group, held in enumerate(groups):
                if set(held) != set(first):
                    raise CheckpointFormatError(
                        f"{self.tag_url!r}: the optimizer state of rank {rank}, partition {group} holds "
                        f"{sorted(held)}, rank 0's partition 0 {sorted(first)}; the files do not belong together"
                    )
                for key, h in held.items():
                    if h.kind == "other":
                        what = f"a tensor of shape {list(h.shape)}" if h.shape else shown(h.value, 60)
                        raise CheckpointFormatError(
                            f"{self.tag_url!r}: the optimizer state {key!r} is {what}, neither one value per "
                            "element of the parameters nor one value per group, so it cannot be re-partitioned "
                            "for another number of ranks; only optimizers whose state is per-parameter tensors "
                            "(Adam, AdamW, SGD with momentum, ...) can"
                        )
                    other_dtype = h.record is not None and h.record.dtype != first[key].record.dtype
                    if h.kind != first[key].kind or other_dtype:
                        raise CheckpointFormatError(
                            f"{self.tag_url!r}: the optimizer state {key!r} differs in kind or dtype between ranks"
                        )
        return sorted(k for k, h in first.items() if h.kind == "element"), sorted(
            k for k, h in first.items() if h.kind == "value"
        )

    def _partition_groups(self, model0: Mapping[str, Any]) -> list[int]:
        """Per flat partition, its param group: ZeRO 1/2 has one partition per param group, ZeRO-3 one per
        sub-group, each listed in one param group's ``params``."""
        to_group = list(range(self.groups))
        if self.stage == 3 and self._groups_read is not None:
            for g, group in enumerate(self._groups_read):
                for index in group.get("params", ()):
                    if 0 <= index < len(to_group):
                        to_group[index] = g
        return to_group

    def _group_of_params(self, model0: Mapping[str, Any]) -> dict[str, int]:
        """Trained parameter name -> its param group: DeepSpeed lists the shapes per flat partition."""
        shapes = model0.get("param_shapes")
        shapes = [shapes] if isinstance(shapes, Mapping) else list(shapes or ())
        return {
            name: self.partition_groups[i] if i < len(self.partition_groups) else i
            for i, group in enumerate(shapes) if isinstance(group, Mapping) for name in group
        }

    @staticmethod
    def _mapping(file: RankFile, value: Any, what: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise CheckpointFormatError(f"{file.display}: {what} is {shown(value, 80)}, not a dict")
        return value

    @staticmethod
    def _bad(file: RankFile, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{file.display}: {what}; DeepSpeed does not write that")



_SCALARS = {"float32": "f", "float64": "d", "int64": "q", "int32": "i", "int16": "h", "int8": "b", "uint8": "B",
            "bool": "?"}


def plain_value(file: RankFile, value: Any, what: str) -> Any:
    """``value`` as the pickle reader built it, as a JSON value, without torch: a one-element tensor read as its
    number; tuples as lists. Anything else (an object, a tensor of several elements) is refused, naming ``what``."""
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise CheckpointFormatError(f"{file.display}: {what} is {value!r}, which JSON cannot hold")
        return value
    if isinstance(value, (list, tuple)):
        return [plain_value(file, item, f"{what}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, TensorRecord) and value.numel == 1:
        record = file.check(value, what)
        raw = memoryview(bytearray(record.itemsize))
        file.read_into(record, 0, raw)
        dtype = record.dtype
        if dtype in ("bfloat16", "float16"):
            raw, dtype = to_float32(raw, dtype), "float32"
        if dtype in _SCALARS:
            return plain_value(file, struct.unpack("=" + _SCALARS[dtype], raw)[0], what)
    raise CheckpointFormatError(
        f"{file.display}: {what} is {shown(value, 80)}, not a number, string or list of them; the optimizer's "
        "state cannot be written as plain values"
    )
