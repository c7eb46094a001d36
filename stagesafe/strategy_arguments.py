"""The strategy's own arguments, checked when it is built: before any process group starts, so that a mistake
fails at once, in one line, naming the argument and what to pass instead of failing on some rank mid-job; and
the DeepSpeed config an inference engine gets from the user's."""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from stagesafe.errors import HandoffNotFoundError, InvalidArgumentError, shown
from stagesafe.flags import checked_flag as checked_bool  # the strategy's flags: one check for the whole API
from stagesafe.storage.fs import check_not_a_file, is_local, resolve
from stagesafe.handoff.names import MANIFEST_NAME

__all__ = [
    "BETWEEN_STAGES",
    "check_between_stages",
    "check_keywords",
    "check_local_handoff",
    "check_optimizer_handoff",
    "check_positional",
    "check_zero_stage",
    "checked_bool",
    "checked_storage_options",
    "checked_url",
    "inference_config",
]

BETWEEN_STAGES = ("cpu", "meta")


def check_keywords(kwargs: Mapping[str, Any], known: Iterable[str], *, owner: str) -> None:
    """A misspelt argument names ``owner`` and the argument meant, not Lightning's base class."""
    names = sorted(set(known) - {"self", "args", "kwargs"})
    for name in kwargs:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}{hint}")


def check_positional(args: tuple, names: Iterable[str], *, owner: str, accelerator: type) -> None:
    """Arguments are taken by keyword. One positional is accepted where Lightning's own takes it: an
    ``accelerator`` (an instance of ``accelerator``, or None); any other lands where it was not meant to
    (``StageSafeDeepSpeedStrategy(3)`` would make 3 the accelerator, the stage staying 2)."""
    if not args or (len(args) == 1 and (args[0] is None or isinstance(args[0], accelerator))):
        return
    landed = ", ".join(f"{name}={shown(value, 40)}" for name, value in zip(names, args))
    stage = args[0] if isinstance(args[0], int) and not isinstance(args[0], bool) and len(args) == 1 else None
    hint = f"; for ZeRO stage {stage} pass stage={stage}" if stage is not None else ""
    raise TypeError(
        f"{owner}() takes its arguments by keyword, but got {len(args)} positional: they would land in "
        f"DeepSpeedStrategy's {landed}{hint}. Pass each argument by name, e.g. {owner}(stage=3)"
    )


def check_zero_stage(value: Any, *, where: str = "stage") -> None:
    """A ZeRO stage is 0, 1, 2 or 3 (an int; ``True`` is refused), as DeepSpeed knows them."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
        raise InvalidArgumentError(
            f"{where}={shown(value, 40)} is not a ZeRO stage: pass 0, 1, 2 (the default) or 3 "
            "(1: optimizer state partitioned; 2: and gradients; 3: and parameters)"
        )


def checked_storage_options(value: Any) -> dict[str, Any]:
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(f"storage_options must be a dict of fsspec options, got {type(value).__name__}")
    return dict(value or {})


def checked_url(name: str, value: Any, storage_options: Mapping[str, Any]) -> Optional[str]:
    """A str URL whose fsspec protocol is known and installed (nothing is read or written yet)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str URL or path, got {type(value).__name__}: {value!r}")
    fs, root = resolve(value, dict(storage_options))  # an unknown protocol or a missing backend fails here, not at fit
    check_not_a_file(fs, root, name)
    return os.fspath(value)


def check_local_handoff(name: str, url: str, storage_options: Mapping[str, Any]) -> None:
    """A handoff on the local disk is looked at now, so that a mistyped path fails here and not once every
    rank has started; one elsewhere is read at the first stage (every rank, before DeepSpeed starts)."""
    fs, root = resolve(url, dict(storage_options))
    if not is_local(fs):
        return
    if not os.path.isdir(root):
        raise HandoffNotFoundError(f"{name}={url!r}: there is no such folder; pass the folder of a committed handoff")
    if not os.path.isfile(os.path.join(root, MANIFEST_NAME)):
        raise HandoffNotFoundError(
            f"{name}={url!r} holds no committed handoff (no {MANIFEST_NAME}); pass the folder a strategy's handoff_uri "
            "or stagesafe.save_state_dict wrote (a DeepSpeed checkpoint folder: consolidate it first, "
            "stagesafe consolidate SRC DST)"
        )


def check_between_stages(value: Any, *, zero_stage_3: Optional[bool]) -> None:
    """``between_stages`` is one of the two modes, and ``"meta"`` has ZeRO stage 3 where the config says
    (``zero_stage_3`` None: a config file, read later)."""
    if value not in BETWEEN_STAGES:
        raise InvalidArgumentError(
            f"between_stages={value!r}: choose 'cpu' (real tensors between stages) or 'meta' (none)"
        )
    if value == "meta" and zero_stage_3 is False:
        raise InvalidArgumentError(
            "between_stages='meta' needs ZeRO stage 3 (stage=3): stages 1 and 2 keep whole weights on every "
            "rank, so an engine cannot be built from the handoff one submodule at a time; use 'cpu'"
        )


def check_optimizer_handoff(value: bool, *, between_stages: str) -> None:
    """``handoff_optimizer_state=True`` needs the engine's state at the fit's end before its weights are written:
    ``between_stages="meta"`` streams the weights out of the engine first, one tensor at a time."""
    if value and between_stages == "meta":
        raise InvalidArgumentError(
            "handoff_optimizer_state=True with between_stages='meta': the meta mode writes a fit's weights one "
            "tensor at a time while gathering them, before the optimizer state could be committed for them to name; "
            "use between_stages='cpu', or save a checkpoint (trainer.save_checkpoint) and run "
            "`stagesafe consolidate --optimizer` on it"
        )


def inference_config(config: Mapping[str, Any], *, zero_stage_3: bool) -> dict[str, Any]:
    """DeepSpeed's config for an inference engine: the precision and, under ZeRO-3, the partitioning of
    ``config``; no optimizer, one sample per step (Lightning's, with ``zero_allow_untested_optimizer`` read
    where the user may have left it out)."""
    inference: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
    for key in ("fp16", "bf16"):
        if key in config:
            inference[key] = copy.deepcopy(config[key])
    if zero_stage_3:
        inference["zero_allow_untested_optimizer"] = config.get("zero_allow_untested_optimizer", True)
        inference["zero_optimization"] = copy.deepcopy(config["zero_optimization"])
    return inference
