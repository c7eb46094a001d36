"""The optimizer state beside a handoff, per parameter: the form that no number of ranks is written into.

A handoff with its optimizer state (``stagesafe consolidate --optimizer``) is two handoffs, each committed and
verified as any other (safetensors shards, index, manifest with every shard's digest):

    DST/stagesafe.json      the weights (fp32 masters of the trained parameters, frozen ones, buffers); its
                            metadata's ``"optimizer"`` entry binds the state: ``{"format", "folder":
                            "optimizer-<tag>", "checksum"}``, the checksum of the state's own manifest
    DST/optimizer-<tag>/    the state: one fp32 tensor ``"<key>/<parameter>"`` of the parameter's shape per key
                            the optimizer holds per element (AdamW: ``exp_avg``, ``exp_avg_sq``); its manifest's
                            metadata ``"optimizer_state"`` holds the rest as JSON (:func:`form_metadata`)

Each write's state goes to a folder of its own (``<tag>``: 8 hex digits), committed before the weights, which name
it and its checksum: until the weights commit, the pair there before stays whole; after it, the state the old
weights named is no longer named and goes. A reader that finds the weights' manifest finds the state it was
written with, or an error saying that the state beside it is another write's. No torch and no tensor data here:
the rules of the form (:func:`form_metadata`, :func:`check_form`) and finding it (:func:`open_form`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stagesafe.errors import HandoffCorruptError, HandoffNotFoundError, InvalidArgumentError, shown
from stagesafe.storage.folder import Folder
from stagesafe.storage.fs import join, list_files, resolve, url_of
from stagesafe.handoff.manifest import check_metadata
from stagesafe.handoff.names import INDEX_NAME, MANIFEST_NAME
from stagesafe.handoff.read import committed_manifest, committed_or_none, read_manifest

__all__ = ["FORM", "FormGroup", "OptimizerForm", "binding", "bound_folder", "check_form", "form_metadata",
           "forget_unbound", "new_folder", "open_form", "refuse_other_dtype", "remove_state", "state_name"]

FORM = "stagesafe-optimizer/1"
_FOLDER_RE = re.compile(r"optimizer-[0-9a-f]{8}")  # the state's handoff, a folder inside the weights' folder
_KEY = "optimizer_state"  # its manifest's metadata entry


def new_folder(fs: Any, root: str) -> str:
    """A state folder's name of a write's own in ``root``: ``optimizer-<8 hex digits>``, none of its folders."""
    taken = set(list_files(fs, root, kind="directory"))
    while True:
        name = f"optimizer-{secrets.token_hex(4)}"
        if name not in taken:
            return name


def bound_folder(weights: Mapping[str, Any]) -> str | None:
    """The state folder the committed weights' manifest names, if it names one of this form's names."""
    bound = weights["metadata"].get("optimizer")
    folder = bound.get("folder") if isinstance(bound, Mapping) else None
    return folder if isinstance(folder, str) and _FOLDER_RE.fullmatch(folder) else None


def state_name(key: str, parameter: str) -> str:
    """The state tensor's name: ``exp_avg/layer.weight``."""
    return f"{key}/{parameter}"


@dataclass(frozen=True)
class FormGroup:
    """One param group: its parameters (names), hyperparameters and one-value state (``{"step": {"dtype":
    "float32", "value": 12.0}}``; a Python number is ``{"value": 12}``)."""

    params: tuple[str, ...]
    hyperparameters: dict[str, Any]
    state: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class OptimizerForm:
    """The optimizer state bound to a handoff: where it is, its manifest, and what its JSON says."""

    url: str  # the state's folder
    manifest: dict[str, Any]
    weights: dict[str, Any]  # the weights' manifest that binds it
    keys: tuple[str, ...]
    groups: tuple[FormGroup, ...]
    loss_scaler: dict[str, Any] | None
    source: dict[str, Any]

    def group_of(self) -> dict[str, int]:
        """Parameter name -> its param group."""
        return {name: index for index, group in enumerate(self.groups) for name in group.params}


def form_metadata(
    *, keys: list[str], groups: list[FormGroup], loss_scaler: Mapping[str, Any] | None, source: Mapping[str, Any]
) -> dict[str, Any]:
    """The state manifest's metadata for the form (checked as :func:`check_form` will read it)."""
    body = {
        "format": FORM,
        "keys": list(keys),
        "param_groups": [
            {"params": list(g.params), "hyperparameters": dict(g.hyperparameters), "state": dict(g.state)}
            for g in groups
        ],
        "loss_scaler": dict(loss_scaler) if loss_scaler is not None else None,
        "source": dict(source),
    }
    return check_metadata({_KEY: body})


def remove_state(fs: Any, root: str, folder: str) -> None:
    """Delete the optimizer state in ``root``/``folder`` that no weights name (the weights beside it could not be
    committed, or newer weights replaced those that named it): its shards and index, its manifest last, then the
    folder if nothing else is in it. Raises what the store raises; a state left behind is read by nothing."""
    state = Folder(fs, join(root, folder))
    manifest = committed_or_none(state)
    state.remove([*(manifest["shards"] if manifest is not None else ()), INDEX_NAME])
    state.remove([MANIFEST_NAME], empty_root=True)


def forget_unbound(fs: Any, root: str, folder: str, *, remove_root: bool = False) -> None:
    """After a write of state and weights failed once the state in ``root``/``folder`` was committed: delete that
    state unless the committed weights in ``root`` name it, and with ``remove_root`` the folder ``root`` too if
    nothing else is in it (the write created it). Nothing is removed where the store cannot say what the weights
    name; raises what the store raises while deleting."""
    weights = Folder(fs, root)
    try:
        bound = bound_folder(committed_manifest(weights, explain=False))
    except (HandoffNotFoundError, HandoffCorruptError):
        bound = None  # no weights: none name it
    except Exception:  # noqa: BLE001 - the store is failing: nothing is removed on a guess
        return
    if bound != folder:
        remove_state(fs, root, folder)
        weights.remove([], empty_root=remove_root)


def binding(folder: str, state_manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The weights' metadata entry that binds the state committed in ``folder`` with manifest ``state_manifest``."""
    return {"format": FORM, "folder": folder, "checksum": state_manifest["checksum"]}


def open_form(uri: str, *, storage_options: dict[str, Any] | None = None) -> OptimizerForm | None:
    """The optimizer state bound to the handoff at ``uri``; None when the handoff holds weights only. Raises
    ``HandoffCorruptError`` when the state is not the one the weights were written with, or its JSON is off."""
    weights = read_manifest(uri, storage_options=storage_options)
    bound = weights["metadata"].get("optimizer")
    if bound is None:
        return None
    folder = bound_folder(weights)
    if not isinstance(bound, Mapping) or bound.get("format") != FORM or folder is None:
        raise HandoffCorruptError(
            f"{uri!r}: its manifest names optimizer state as {shown(bound, 120)}, not a form this stagesafe reads "
            f"({FORM}, in a folder optimizer-<8 hex digits>); upgrade stagesafe, or consolidate the checkpoint again"
        )
    fs, root = resolve(uri, storage_options)
    url = url_of(fs, join(root, folder))
    try:
        state = read_manifest(url, storage_options=storage_options)
    except HandoffNotFoundError:
        raise HandoffCorruptError(
            f"{uri!r}: its manifest names optimizer state in {folder!r}, but {url!r} holds none; the handoff is "
            "incomplete: write it again (stagesafe consolidate --optimizer --overwrite)"
        ) from None
    if state["checksum"] != bound.get("checksum"):
        raise HandoffCorruptError(
            f"{uri!r}: the optimizer state in {url!r} is not the one these weights were written with (its manifest "
            f"checksum is {state['checksum'][:16]}..., the weights name {str(bound.get('checksum'))[:16]}...): "
            "another write replaced one of them. Write both again (stagesafe consolidate --optimizer --overwrite)"
        )
    return check_form(url, state, weights)


def check_form(url: str, state: Mapping[str, Any], weights: Mapping[str, Any]) -> OptimizerForm:
    """The form in the committed state manifest ``state`` (at ``url``), bound to ``weights``: its JSON well
    formed, every trained parameter once, with an fp32 tensor of its shape for every key, and its fp32 master
    among the weights."""

    def bad(what: str) -> HandoffCorruptError:
        return HandoffCorruptError(f"{url!r}: {what}; the optimizer state cannot be trusted, write it again")

    body = state["metadata"].get(_KEY)
    if not isinstance(body, Mapping) or body.get("format") != FORM:
        raise bad(f"its manifest's metadata holds no {FORM} form")
    keys, groups = body.get("keys"), body.get("param_groups")
    if not isinstance(keys, list) or not all(isinstance(k, str) and k and "/" not in k for k in keys):
        raise bad(f"its keys are {shown(keys, 80)}, not a list of names")
    if not isinstance(groups, list) or not groups:
        raise bad("it lists no param groups")
    out, seen = [], set()
    for index, group in enumerate(groups):
        params = group.get("params") if isinstance(group, Mapping) else None
        hyper, values = (group.get("hyperparameters"), group.get("state")) if isinstance(group, Mapping) else (0, 0)
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise bad(f"param group {index} names its parameters as {shown(params, 80)}")
        if not isinstance(hyper, Mapping) or not isinstance(values, Mapping):
            raise bad(f"param group {index} lacks its hyperparameters or its state")
        for key, value in values.items():
            if not isinstance(value, Mapping) or "value" not in value or not set(value) <= {"dtype", "value"}:
                raise bad(f"param group {index}'s state {key!r} is {shown(value, 80)}")
        twice = seen & set(params)
        if twice:
            raise bad(f"{sorted(twice)[:3]} are in two param groups")
        seen |= set(params)
        out.append(FormGroup(tuple(params), dict(hyper), {str(k): dict(v) for k, v in values.items()}))
    tensors, described = state["tensors"], weights["tensors"]
    for name in sorted(seen):
        master = described.get(weights["aliases"].get(name, name))
        if master is None:
            raise bad(f"the weights beside it lack the trained parameter {name!r}")
        if master["dtype"] != "float32":
            raise bad(f"the weights hold {name!r} as {master['dtype']}, not its fp32 master")
        for key in keys:
            spec = tensors.get(state_name(key, name))
            if spec is None or spec["dtype"] != "float32" or spec["shape"] != master["shape"]:
                raise bad(f"{state_name(key, name)!r} is {shown(spec, 80)}, not fp32 of shape {master['shape']}")
    extra = set(tensors) - {state_name(k, n) for k in keys for n in seen}
    if extra:
        raise bad(f"it holds {sorted(extra)[:3]}, which no param group names")
    scaler = body.get("loss_scaler")
    source = body.get("source")
    return OptimizerForm(url, dict(state), dict(weights), tuple(keys), tuple(out),
                         dict(scaler) if isinstance(scaler, Mapping) else None,
                         dict(source) if isinstance(source, Mapping) else {})


def refuse_other_dtype(dtype: str | None) -> None:
    """The form's masters are the weights: written in fp32 only."""
    if dtype not in (None, "float32"):
        raise InvalidArgumentError(
            f"dtype={dtype!r} with the optimizer state: the state is resumed from the fp32 master weights, which a "
            "cast would lose; consolidate without a dtype (fp32), or without the optimizer state"
        )
