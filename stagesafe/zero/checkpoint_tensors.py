"""What a ZeRO checkpoint's tensors are, and which bytes of which rank files hold each, from the files' structure.

:func:`describe` opens a tag folder's rank files (:class:`RankFiles`) and reads only their pickles' structure:
every tensor is a :class:`~stagesafe.zero.pickle_globals.TensorRecord` (where its bytes are, nothing read). From
it comes each tensor of the state dict as DeepSpeed's ``utils/zero_to_fp32.py`` builds it: buffers from the saved
module (floating ones as fp32), frozen parameters from their fragments, and trained parameters from the ranks'
fp32 partitions (stage 1/2: the rank partitions of a param group, concatenated; stage 3: each parameter's slice of
every rank, concatenated and unpadded), as a :class:`TensorSpec` and the :class:`Piece` runs of the files that
hold its values in order. Every count and size is checked against the files before anything is allocated: the
world size against the rank files present, each tensor against the bytes its file really holds, each name and
shape against what a state dict can hold; a refusal names the file and says what DeepSpeed writes. Needs no torch.

Differences from ``zero_to_fp32``: frozen parameters of stage-1 checkpoints (which DeepSpeed does not list in
``frozen_param_shapes``) are read from the saved module, so they are not lost; tied names are reported as
aliases of the tensor they share.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from stagesafe.errors import CheckpointFormatError, shown
from stagesafe.zero.checkpoint_folder import RankFileNames
from stagesafe.zero.pickle_globals import FLOATING, ITEMSIZE, TensorRecord
from stagesafe.zero.rank_file import RankFile

__all__ = ["CheckpointTensors", "Piece", "RankFiles", "TensorSpec", "client_entries", "describe"]

# Keys DeepSpeed writes into *_model_states.pt; everything else there is the caller's client_state.
_DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
    }
)
_MAX_RANK = 2**20  # ranks numbered beyond this are not a data-parallel world DeepSpeed writes


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the checkpoint as :meth:`ZeroCheckpoint.read` returns it, described without reading it."""

    name: str
    dtype: str  # as torch names it, without "torch.": "float32", "bfloat16", "int64", ...
    shape: tuple[int, ...]
    kind: str  # "buffer", "frozen" (not trained) or "param" (fp32 master weight)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


class Piece(NamedTuple):
    """Elements ``[start, start + length)`` of a flat tensor of a rank file, checked against the file."""

    file: RankFile
    tensor: TensorRecord
    start: int
    length: int


@dataclass(frozen=True)
class CheckpointTensors:
    """What :func:`describe` found: the tensors in DeepSpeed's state-dict order (buffers, frozen, trained), the
    pieces holding each one's values in order, and what else rank 0's model states say."""

    stage: int
    world_size: int
    ds_version: str | None
    specs: dict[str, TensorSpec]
    aliases: dict[str, str]  # tied name -> the stored name it shares its tensor with
    sources: dict[str, tuple[Piece, ...]]
    client_file: RankFile  # rank 0's model states, which hold the client state
    client_state: dict[str, Any]  # its entries that are not DeepSpeed's, as the pickle reader built them
    # what the optimizer state is read through (:mod:`.checkpoint_optimizer`): ``partitions[rank][group]`` is the
    # rank's flat fp32 partition of a group (the very records the params' pieces name), ``optimizer_states[rank]``
    # its optimizer file's ``optimizer_state_dict`` and ``model_states`` every model-states file, as read
    partitions: tuple[tuple[tuple[RankFile, TensorRecord], ...], ...] = ()
    optimizer_states: tuple[tuple[RankFile, Mapping[str, Any]], ...] = ()
    model_states: tuple[tuple[RankFile, Mapping[str, Any]], ...] = ()


def client_entries(states: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a model-states dict that DeepSpeed did not write (the caller's client state)."""
    return {k: v for k, v in states.items() if k not in _DEEPSPEED_KEYS}


class RankFiles:
    """Opens the rank files of one tag folder (a local copy of it for a remote checkpoint), safely, and keeps every
    file it opened in :attr:`opened`, for the caller to close."""

    def __init__(self, local_dir: str, tag_url: str, *, trusted: bool):
        self.local_dir, self.tag_url, self.trusted = local_dir, tag_url, trusted
        self.opened: list[RankFile] = []

    def load(self, name: str) -> tuple[RankFile, dict]:
        """The file ``name`` and the dict of states its pickle holds."""
        file = RankFile(self.local_dir, name, display=f"{self.tag_url}/{name}", trusted=self.trusted)
        self.opened.append(file)
        if not isinstance(file.content, dict):
            raise CheckpointFormatError(
                f"{self.tag_url}/{name} holds a {type(file.content).__name__}, not DeepSpeed's dict of states"
            )
        return file, file.content

    def close(self) -> None:
        for file in self.opened:
            file.close()


def describe(files: RankFiles, names: RankFileNames, *, exclude_frozen: bool) -> CheckpointTensors:
    """Every tensor of the checkpoint whose rank files are ``names``, opened by ``files``, and where it lies."""
    partitions = _read_partitions(files, names)
    models = _read_model_states(files, names, partitions)
    model0_file, model0 = models[0]
    tensors = _Tensors(files.tag_url, _Structure(model0_file))
    buffer_names = tensors.add_buffers(model0_file, model0)
    param_shapes = _param_shapes(tensors.check, model0["param_shapes"])
    trained = {name for group in param_shapes for name in group}
    shared = dict(tensors.check.mapping(model0.get("shared_params") or {}, "shared_params"))
    if not exclude_frozen:
        not_frozen = buffer_names | trained | set(shared)
        tensors.add_frozen(models, partitions.stage, not_frozen)
    if partitions.stage == 3:
        _zero3_params(tensors, partitions, param_shapes)
    else:
        _zero12_params(tensors, partitions, param_shapes)
    ds_version = model0.get("ds_version")
    return CheckpointTensors(
        stage=partitions.stage,
        world_size=partitions.world_size,
        ds_version=ds_version if isinstance(ds_version, str) and len(ds_version) <= 100 else None,
        specs=tensors.specs,
        aliases=_aliases(shared, tensors.specs),
        sources=tensors.sources,
        client_file=model0_file,
        client_state=client_entries(model0),
        partitions=tuple(tuple(groups) for groups in partitions.flat),
        optimizer_states=tuple(partitions.states),
        model_states=tuple(models),
    )


# -- the rank files' structure ---------------------------------------------------------------------------------------


class _Structure:
    """Checks of the values a rank file's pickle holds: each refusal names the file and what DeepSpeed writes."""

    def __init__(self, file: RankFile):
        self.file = file

    def bad(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{self.file.display}: {what}; DeepSpeed does not write that: the file was crafted or damaged"
        )

    def mapping(self, value: Any, what: str) -> Mapping:
        if not isinstance(value, Mapping):
            raise self.bad(f"{what} is {shown(value, 80)}, not a dict")
        return value

    def sequence(self, value: Any, what: str) -> Sequence:
        if not isinstance(value, (list, tuple)):
            raise self.bad(f"{what} is {shown(value, 80)}, not a list")
        return value

    def count(self, value: Any, what: str) -> int:
        if type(value) is not int or not 0 <= value <= 2**62:
            raise self.bad(f"{what} is {shown(value, 80)}, not a count")
        return value

    def name(self, value: Any, what: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.bad(f"{what} has the name {shown(value, 80)}, not a non-empty str")
        return value

    def shape(self, value: Any, name: str) -> tuple[int, ...]:
        """A shape of non-negative ints, whose element count, and each size (a 0 beside a huge size would hide it),
        stays below 2**62: bounded by the file anyway, and torch's sizes are int64."""
        if not isinstance(value, (list, tuple)) or len(value) > 64:
            raise self.bad(f"the shape of {shown(name, 80)} is {shown(value, 80)}, not a list of sizes")
        n = 1
        for d in value:
            if type(d) is not int or d < 0:
                raise self.bad(f"the shape of {shown(name, 80)} is {shown(value, 80)}: sizes are non-negative ints")
            n *= d
            if n > 2**62 or d > 2**62:
                raise self.bad(f"the shape of {shown(name, 80)} is {shown(value, 80)}, far more elements than any file")
        return tuple(value)


@dataclass
class _Partitions:
    """The optimizer files' fp32 partitions: ``flat[rank][group]`` is rank's flat partition of a param group."""

    stage: int
    world_size: int
    flat: list[list[tuple[RankFile, TensorRecord]]]
    paddings: Any  # stage 1/2: per group, the alignment padding after each param (as rank 0 says), or None
    states: list[tuple[RankFile, Mapping[str, Any]]]  # per rank: its file and its optimizer_state_dict


def _read_partitions(files: RankFiles, names: RankFileNames) -> _Partitions:
    """Rank 0's optimizer file says the stage and the world size; every rank's file is there, and its partitions
    are checked against it (the Adam moments and the rest are never read)."""
    first_name = names.optim[min(names.optim)]
    first_file, first = files.load(first_name)
    check = _Structure(first_file)
    osd0 = first.get("optimizer_state_dict")
    if not isinstance(osd0, dict) or "partition_count" not in osd0:
        raise CheckpointFormatError(
            f"{files.tag_url}/{first_name} has no ZeRO optimizer state (optimizer_state_dict with "
            "partition_count); it is not a ZeRO checkpoint file"
        )
    stage = _stage(check, osd0, first)
    world_size = _world_size(check, osd0["partition_count"])
    _missing_ranks(files.tag_url, names.optim, world_size, first_name, "optimizer file")
    if (stage == 3) != names.zero3_model:
        raise CheckpointFormatError(
            f"{files.tag_url!r}: optimizer files say ZeRO stage {stage} but the model-state files are named for stage "
            f"{'3' if names.zero3_model else '1/2'}; files of two runs are mixed, save into an empty folder"
        )
    groups_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flat, states = [], []
    for rank in range(world_size):
        loaded = (first_file, first) if rank == 0 and min(names.optim) == 0 else files.load(names.optim[rank])
        flat.append(_flat_groups(*loaded, groups_key))
        states.append((loaded[0], loaded[1].get("optimizer_state_dict")))
    return _Partitions(stage, world_size, flat, osd0.get("param_alignment_paddings"), states)


def _flat_groups(file: RankFile, states: dict, groups_key: str) -> list[tuple[RankFile, TensorRecord]]:
    """A rank's flat fp32 partitions, each checked against its file."""
    check = _Structure(file)
    osd = check.mapping(states.get("optimizer_state_dict", {}), "optimizer_state_dict")
    groups = check.sequence(osd.get(groups_key), f"{groups_key!r}")
    return [(file, file.check(t, f"{groups_key}[{i}]").flat()) for i, t in enumerate(groups)]


def _read_model_states(files: RankFiles, names: RankFileNames, partitions: _Partitions) -> list[tuple[RankFile, dict]]:
    """Every rank's model states (stage 3; one file for stages 1 and 2), rank 0's checked for the keys read."""
    if partitions.stage == 3:
        example = names.model[min(names.model)]
        _missing_ranks(files.tag_url, names.model, partitions.world_size, example, "optimizer file")
    models = [files.load(names.model[rank]) for rank in sorted(names.model)]
    model0 = models[0][1]
    for key in ("module", "buffer_names", "param_shapes"):
        if key not in model0:
            raise CheckpointFormatError(
                f"{files.tag_url}/{names.model[0]} has no {key!r}: it is not a model-states file"
            )
    autoep = model0.get("ds_autoep_layers", model0.get("autoep_layers"))
    if isinstance(autoep, list) and any(
        isinstance(e, dict) and e.get("checkpoint_format") == "zero3_partitioned" for e in autoep
    ):
        raise CheckpointFormatError(
            f"{files.tag_url!r} is an AutoEP ZeRO-3 partition-native checkpoint, whose experts are partitioned over "
            "expert groups; stagesafe cannot consolidate it: use DeepSpeed's ds_to_universal.py"
        )
    return models


def _stage(check: _Structure, osd: Mapping[str, Any], sd: Mapping[str, Any]) -> int:
    stage = osd.get("zero_stage")
    if stage is None:  # DeepSpeed's BF16_Optimizer (bf16 with ZeRO-1) does not record it; its config does
        config = sd.get("ds_config") or {}
        zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
        stage = zero.get("stage", 1) if isinstance(zero, Mapping) else 1
    if type(stage) is not int or stage not in (1, 2, 3):
        raise check.bad(f"ZeRO stage {shown(stage, 40)} is not one stagesafe reads (1, 2 or 3)")
    return stage


def _world_size(check: _Structure, partition_count: Any) -> int:
    counts = list(partition_count) if isinstance(partition_count, (list, tuple)) else [partition_count]
    if not counts or any(type(c) is not int or not 1 <= c <= _MAX_RANK for c in counts):
        raise check.bad(f"partition_count is {shown(partition_count, 80)}, not a positive number of ranks")
    return max(counts)


def _missing_ranks(tag_url: str, have: Mapping[int, str], world_size: int, example: str, what: str) -> None:
    """Refuse rank files that are not those of ranks 0 to ``world_size - 1``, naming the first few missing."""
    missing = []
    for rank in range(min(world_size, len(have) + 4)):  # the first few missing, whatever world_size claims
        if rank not in have:
            missing.append(rank)
    extra = sorted(r for r in have if r >= world_size)
    if missing:
        names = [re.sub(r"rank_\d+_mp", f"rank_{r}_mp", example) for r in missing[:3]]
        held = len(have) - len(extra)
        raise CheckpointFormatError(
            f"{tag_url!r} is missing rank files {names}{' ...' if world_size - held > 3 else ''}: the checkpoint was "
            f"written by {world_size} ranks (partition_count in rank 0's {what}) but only {held} of their files are "
            "here; a rank's save failed or the folder was copied partially"
        )
    if extra:
        raise CheckpointFormatError(
            f"{tag_url!r} holds files of ranks {shown(extra[:10], 200)} beyond the {world_size} that wrote this "
            "checkpoint; a checkpoint of another run was saved into the same folder: save into an empty folder"
        )


def _param_shapes(check: _Structure, param_shapes: Any) -> list[Mapping]:
    """The trained parameters' shapes, a dict of name -> shape per param group."""
    if isinstance(param_shapes, Mapping):
        param_shapes = [param_shapes]
    return [check.mapping(group, "a group of param_shapes") for group in check.sequence(param_shapes, "param_shapes")]


def _aliases(shared: Mapping[Any, Any], specs: Mapping[str, TensorSpec]) -> dict[str, str]:
    """Tied name -> the stored name it shares its tensor with, for the names DeepSpeed lists as shared."""
    return {
        alias: canonical
        for alias, canonical in shared.items()
        if isinstance(alias, str) and alias and isinstance(canonical, str) and canonical in specs and alias not in specs
    }


# -- the tensors -----------------------------------------------------------------------------------------------------


class _Tensors:
    """The tensors described so far, in order, each with the pieces of the files that hold its values; ``check``
    is rank 0's model states' structure."""

    def __init__(self, tag_url: str, check: _Structure):
        self.tag_url, self.check = tag_url, check
        self.specs: dict[str, TensorSpec] = {}
        self.sources: dict[str, tuple[Piece, ...]] = {}

    def add(self, name: Any, dtype: str, shape: Any, kind: str, pieces: Sequence[Piece]) -> None:
        """Add a tensor, once its name and shape are checked and its pieces hold exactly its elements."""
        name = self.check.name(name, f"a {kind} tensor")
        if name in self.specs:
            raise CheckpointFormatError(
                f"{self.tag_url!r}: tensor {shown(name)} is listed twice (as {self.specs[name].kind} and {kind})"
            )
        spec = TensorSpec(name, dtype, self.check.shape(shape, name), kind)
        held = sum(piece.length for piece in pieces)
        if held != spec.numel:
            raise CheckpointFormatError(
                f"{self.tag_url!r}: the rank files hold {held} elements for {shown(name)}, whose shape "
                f"{list(spec.shape)[:8]} needs {spec.numel}; the files do not belong together"
            )
        self.specs[name] = spec
        self.sources[name] = tuple(p for p in pieces if p.length > 0)

    def add_buffers(self, file: RankFile, model0: dict) -> set[str]:
        """The saved module's buffers, in its order, floating ones as fp32 (like zero_to_fp32); returns the names
        rank 0 lists as buffers."""
        listed = self.check.sequence(list(model0["buffer_names"]), "buffer_names")
        buffer_names = {n for n in listed if isinstance(n, str)}
        for name, value in self.check.mapping(model0["module"], "module").items():
            if name in buffer_names and isinstance(value, TensorRecord):
                value = file.check(value, f"buffer {shown(name, 80)}")
                dtype = "float32" if value.dtype in FLOATING else value.dtype
                self.add(name, dtype, value.shape, "buffer", [Piece(file, value.flat(), 0, value.numel)])
        return buffer_names

    def add_frozen(self, models: list[tuple[RankFile, dict]], stage: int, not_frozen: set[Any]) -> None:
        """The frozen parameters: those rank 0 lists, from their fragments (stage 3: one per rank); a stage-1
        checkpoint lists none, and its saved module holds them whole, in the training dtype."""
        model0_file, model0 = models[0]
        frozen_shapes = model0.get("frozen_param_shapes")
        if frozen_shapes:
            for name, shape in self.check.mapping(frozen_shapes, "frozen_param_shapes").items():
                if stage == 3:
                    self._add_partitioned_frozen(models, name, shape)
                else:
                    self._add_listed_frozen(model0_file, model0, name, shape)
        elif stage < 3 and frozen_shapes is None:
            for name, value in self.check.mapping(model0["module"], "module").items():
                if name not in not_frozen and isinstance(value, TensorRecord) and value.numel > 0:
                    value = model0_file.check(value, f"frozen {shown(name, 80)}")
                    pieces = [Piece(model0_file, value.flat(), 0, value.numel)]
                    self.add(name, value.dtype, value.shape, "frozen", pieces)

    def _add_partitioned_frozen(self, models: list[tuple[RankFile, dict]], name: Any, shape: Any) -> None:
        """Stage 3: each rank's model states hold a fragment; the first ``numel`` elements of them, in rank order."""
        numel = math.prod(self.check.shape(shape, name))
        frags = []
        for file, states in models:
            fragments = _Structure(file).mapping(states.get("frozen_param_fragments", {}), "frozen fragments")
            if fragments.get(name) is None:
                raise CheckpointFormatError(
                    f"{self.tag_url!r}: a rank's model states lack the frozen parameter {shown(name)}"
                )
            frags.append((file, file.check(fragments[name], f"frozen {shown(name, 80)}").flat()))
        pieces, left = [], numel
        for file, frag in frags:
            take = min(frag.numel, left)
            pieces.append(Piece(file, frag, 0, take))
            left -= take
        self.add(name, frags[0][1].dtype, shape, "frozen", pieces)

    def _add_listed_frozen(self, file: RankFile, model0: dict, name: Any, shape: Any) -> None:
        """Stages 1 and 2: the model states hold the parameter whole."""
        fragments = self.check.mapping(model0.get("frozen_param_fragments") or {}, "frozen_param_fragments")
        if fragments.get(name) is None:
            raise CheckpointFormatError(f"{self.tag_url!r}: the model states lack the frozen parameter {shown(name)}")
        frag = file.check(fragments[name], f"frozen {shown(name, 80)}").flat()
        self.add(name, frag.dtype, shape, "frozen", [Piece(file, frag, 0, frag.numel)])


def _zero12_params(tensors: _Tensors, partitions: _Partitions, param_shapes: list[Mapping]) -> None:
    """Stage 1/2: group ``g`` is the concatenation of every rank's partition ``g``; params lie in it in order."""
    flat, world_size, check, tag_url = partitions.flat, partitions.world_size, tensors.check, tensors.tag_url
    n_groups = len(flat[0])
    if any(len(groups) != n_groups for groups in flat) or len(param_shapes) != n_groups:
        raise CheckpointFormatError(
            f"{tag_url!r}: the rank files disagree on the number of parameter groups "
            f"({shown([len(g) for g in flat], 80)} partitions, {len(param_shapes)} groups of shapes)"
        )
    paddings = partitions.paddings
    if paddings is not None:
        paddings = [check.sequence(p, "param_alignment_paddings") for p in check.sequence(paddings, "paddings")]
    align = 2 * world_size  # ZeRO-2 pads each group to a multiple of 2 * world size (as zero_to_fp32 checks)
    for g, shapes in enumerate(param_shapes):
        parts = [flat[r][g] for r in range(world_size)]
        ends = _ends(parts)
        avail = ends[-1] if ends else 0
        pads = paddings[g] if paddings is not None and g < len(paddings) else None
        if paddings is not None and (pads is None or len(pads) != len(shapes)):
            raise CheckpointFormatError(
                f"{tag_url!r}: group {g} has {len(shapes)} params but {len(pads or ())} alignment paddings"
            )
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(check.shape(shape, name))
            if offset + numel > avail:
                raise CheckpointFormatError(
                    f"{tag_url!r}: parameter {shown(name)} ends at element {offset + numel} of group {g}, which "
                    f"holds {avail}; the files do not belong together"
                )
            tensors.add(name, parts[0][1].dtype, shape, "param", _ranges(parts, ends, offset, numel))
            offset += numel + (check.count(pads[i], "an alignment padding") if pads is not None else 0)
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise CheckpointFormatError(
                f"{tag_url!r}: the parameters of group {g} take {offset} elements but the ranks hold {avail}; "
                "the files do not belong together"
            )


def _zero3_params(tensors: _Tensors, partitions: _Partitions, param_shapes: list[Mapping]) -> None:
    """Stage 3: each param is split into ``ceil(numel / world)`` elements per rank, at one offset on every rank."""
    flat, world_size, check, tag_url = partitions.flat, partitions.world_size, tensors.check, tensors.tag_url
    ends = [_ends(groups) for groups in flat]
    totals = [e[-1] if e else 0 for e in ends]
    if len(set(totals)) != 1:
        raise CheckpointFormatError(f"{tag_url!r}: the ranks hold partitions of different sizes {shown(totals, 200)}")
    dtype = flat[0][0][1].dtype if flat[0] else "float32"
    offset = 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(check.shape(shape, name))
            part = math.ceil(numel / world_size)
            if offset + part > totals[0]:
                raise CheckpointFormatError(
                    f"{tag_url!r}: parameter {shown(name)} needs elements up to {offset + part} on each rank, which "
                    f"holds {totals[0]}; the files do not belong together"
                )
            pieces = []
            for rank in range(world_size):
                take = max(0, min(part, numel - rank * part))
                pieces.extend(_ranges(flat[rank], ends[rank], offset, take))
            tensors.add(name, dtype, shape, "param", pieces)
            offset += part
    if offset != totals[0]:
        raise CheckpointFormatError(
            f"{tag_url!r}: the parameters take {offset} elements per rank but each rank holds {totals[0]}; "
            "the files do not belong together"
        )


def _ranges(
    parts: Sequence[tuple[RankFile, TensorRecord]], ends: Sequence[int], start: int, length: int
) -> list[Piece]:
    """Pieces of the virtual concatenation of the 1-D tensors ``parts``, whose cumulative ends are ``ends``,
    covering ``[start, start + length)``; found by bisection, so many parts cost no more than a few."""
    pieces = []
    i = bisect.bisect_right(ends, start)
    while length > 0 and i < len(parts):
        file, tensor = parts[i]
        begin = ends[i] - tensor.numel
        take = min(start + length, ends[i]) - start
        if take > 0:
            pieces.append(Piece(file, tensor, start - begin, take))
            start += take
            length -= take
        i += 1
    return pieces


def _ends(parts: Sequence[tuple[RankFile, TensorRecord]]) -> list[int]:
    ends, total = [], 0
    for _, tensor in parts:
        total += tensor.numel
        ends.append(total)
    return ends
