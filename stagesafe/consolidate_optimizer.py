"""A DeepSpeed checkpoint's optimizer state written beside its consolidated weights, per parameter.

:func:`optimizer_state_beside` writes it into a new folder of the weights' and commits it before them, and takes it
away again if the weights are not committed. It writes the form of :mod:`stagesafe.handoff.optimizer_state`: each
trained parameter's slice of every per-element state (Adam's moments) gathered from whichever ranks hold it, as
one fp32 tensor per parameter and key, and the one-value state (step counts), the param groups' hyperparameters
and the loss scaler as JSON, in a folder of the write's own. Like :func:`stagesafe.consolidate`, it needs no torch:
the rank files' bytes go to the shards as they are, a run of at most 16 MiB at a time, so memory is set by the
shard writer, not by the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from stagesafe.errors import CheckpointFormatError
from stagesafe.publishing.commit import write_and_replace
from stagesafe.storage.fs import join
from stagesafe.handoff.optimizer_state import FormGroup, binding, forget_unbound, form_metadata, new_folder, state_name
from stagesafe.handoff.plan import plan_specs
from stagesafe.handoff.shards import Pieces
from stagesafe.zero.checkpoint import ZeroCheckpoint, read_in_runs
from stagesafe.zero.checkpoint_optimizer import CheckpointOptimizer

__all__ = ["optimizer_state_beside"]


@contextlib.contextmanager
def optimizer_state_beside(
    ckpt: ZeroCheckpoint,
    fs: Any,
    root: str,
    *,
    max_shard_size: int,
    workers: int,
    progress: bool | None,
    source: dict[str, Any],
    created: bool,
) -> Iterator[dict[str, Any]]:
    """Write ``ckpt``'s optimizer state into a new folder of ``root`` and commit it; yield the entry of the weights'
    metadata that binds it (:func:`~stagesafe.handoff.optimizer_state.binding`), for the weights written in the
    block. If they fail, the state goes again unless committed weights name it, and ``root`` too where the write
    ``created`` it and nothing else is in it (best effort: the weights' error is the one raised)."""
    folder = new_folder(fs, root)
    state = _write_state(ckpt, fs, root, folder, max_shard_size=max_shard_size, workers=workers, progress=progress,
                         source=source)
    try:
        yield binding(folder, state)
    except BaseException:
        with contextlib.suppress(Exception):
            forget_unbound(fs, root, folder, remove_root=created)
        raise


def _write_state(
    ckpt: ZeroCheckpoint,
    fs: Any,
    root: str,
    folder: str,
    *,
    max_shard_size: int,
    workers: int,
    progress: bool | None,
    source: dict[str, Any],
) -> dict[str, Any]:
    """Write ``ckpt``'s optimizer state into the new folder ``root``/``folder`` and commit it; return its manifest.
    Refuses state that is not per parameter (:class:`~stagesafe.zero.checkpoint_optimizer.CheckpointOptimizer`
    names it) and per-element state that is not fp32, before anything is written."""
    optimizer = CheckpointOptimizer(ckpt)
    groups, specs = _groups(optimizer), {}
    for key in optimizer.element_keys:
        if optimizer.element_dtypes[key] != "float32":
            raise CheckpointFormatError(
                f"{ckpt.tag_url!r}: the optimizer state {key!r} is {optimizer.element_dtypes[key]}; the form beside "
                "the weights holds fp32 state only"
            )
        for name in optimizer.trained():
            specs[state_name(key, name)] = {"dtype": "float32", "shape": list(ckpt.tensors[name].shape)}
    state_root = join(root, folder)  # a new folder (:func:`~stagesafe.handoff.optimizer_state.new_folder`): no file
    sizes = {name: 4 * _numel(spec["shape"]) for name, spec in specs.items()}  # of it is in the way
    plan = plan_specs(specs, {}, max_shard_size=max_shard_size, state_dict=_LazyState(optimizer, specs), sizes=sizes)
    metadata = form_metadata(keys=optimizer.element_keys, groups=groups, loss_scaler=optimizer.plain_loss_scaler(),
                             source=source)
    return write_and_replace(fs, state_root, plan, what=f"optimizer state of {ckpt.tag}", progress=progress,
                             metadata=metadata, workers=workers, remove_root=True)


def _groups(optimizer: CheckpointOptimizer) -> list[FormGroup]:
    """Each param group: its trained parameters, hyperparameters and one-value state (its first partition's)."""
    trained = optimizer.trained()
    hyper = optimizer.plain_param_groups()
    count = len(hyper) if hyper is not None else max(trained.values(), default=-1) + 1
    return [
        FormGroup(
            params=tuple(name for name, g in trained.items() if g == group),
            hyperparameters=hyper[group] if hyper is not None else {},
            state=optimizer.plain_values(optimizer.partition_of_group(group)) if optimizer.groups else {},
        )
        for group in range(count)
    ]


class _LazyState:
    """The state tensors as a mapping that reads each one's runs from the rank files as its bytes are due."""

    def __init__(self, optimizer: CheckpointOptimizer, specs: dict[str, dict[str, Any]]) -> None:
        self._optimizer, self._specs = optimizer, specs
        self.on_read: Any = None

    def __getitem__(self, name: str) -> Pieces:
        key, _, parameter = name.partition("/")
        spec = self._specs[name]
        if self.on_read is not None:
            self.on_read(4 * _numel(spec["shape"]))
        pieces = self._optimizer.element_pieces(parameter, key)
        return Pieces("float32", tuple(spec["shape"]), read_in_runs(pieces, "float32"))

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
