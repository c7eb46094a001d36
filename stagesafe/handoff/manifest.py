"""The manifest ``stagesafe.json``, the commit of a handoff: built, checksummed and validated.

Pure: no torch and no fsspec, so that every rule of the manifest is tested with plain data and the CLI can
use it without importing torch. The names of the files are :mod:`~stagesafe.handoff.names`'s; the index is
:mod:`~stagesafe.handoff.index`'s.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import stagesafe.handoff.digest as _digest
from stagesafe.errors import HandoffCorruptError, InvalidArgumentError, shown
from stagesafe.handoff.codec import check_tensor
from stagesafe.handoff.names import is_shard_name

__all__ = [
    "FORMAT",
    "FORMATS",
    "build_manifest",
    "check_metadata",
    "digest_of",
    "manifest_checksum",
    "shard_digest",
    "validate_manifest",
]

FORMAT = "stagesafe/2"  # names its shards' digest ("digest"); written unless that digest is sha256
FORMATS = ("stagesafe/1", FORMAT)  # stagesafe/1: sha256, what every handoff recorded before; still read


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a JSON-plain copy of the caller's metadata, or say which entry JSON cannot hold.

    Strict JSON: string keys, finite numbers; tuples become lists. Checked before anything is written.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    return _plain_json(metadata, "metadata")


def _plain_json(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{where} is {value!r}, which strict JSON cannot hold; store it as a string")
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidArgumentError(
                    f"{where} has key {key!r} of type {type(key).__name__}; JSON keys are strings"
                )
            out[key] = _plain_json(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
    hint = "; convert it with .item() or .tolist()" if hasattr(value, "item") else ""
    raise InvalidArgumentError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__} ({value!r:.60}), not a JSON value "
        f"(None, bool, int, float, str, list, dict){hint}"
    )


def build_manifest(
    *,
    digest: str,
    shards: Mapping[str, Mapping[str, Any]],
    weight_map: Mapping[str, str],
    tensors: Mapping[str, Mapping[str, Any]],
    aliases: Mapping[str, str],
    total_size: int,
    metadata: Mapping[str, Any] | None,
    versions: Mapping[str, str | None],
    created: str,
) -> dict[str, Any]:
    """The manifest ``stagesafe.json``; validated here so that a writer never commits one a reader would refuse.

    ``shards`` maps each file to ``{"hexdigest", "size"}``, hashed with ``digest``. A manifest of sha256 shards
    is written as format ``stagesafe/1``, exactly as before, so that an older stagesafe reads it; any other
    digest makes it ``stagesafe/2``, which an older stagesafe refuses with "upgrade stagesafe" rather than
    taking the handoff for a damaged one.
    """
    _digest.check_name(digest)
    legacy = digest == _digest.LEGACY
    manifest: dict[str, Any] = {"format": FORMATS[0] if legacy else FORMAT}
    if not legacy:
        manifest["digest"] = digest
    manifest.update(
        {
            "created": created,
            "shards": {name: {digest: rec["hexdigest"], "size": int(rec["size"])} for name, rec in shards.items()},
            "weight_map": dict(weight_map),
            "tensors": {
                name: {"dtype": meta["dtype"], "shape": list(map(int, meta["shape"]))}
                for name, meta in tensors.items()
            },
            "aliases": dict(aliases),
            "total_size": int(total_size),
            "metadata": check_metadata(metadata),
            "versions": dict(versions),
        }
    )
    manifest["checksum"] = manifest_checksum(manifest)
    return _validated(manifest, source="the new manifest", checksum_known=True)


def digest_of(manifest: Mapping[str, Any]) -> str:
    """The digest a validated manifest records for its shards (sha256 for format ``stagesafe/1``)."""
    return manifest.get("digest", _digest.LEGACY)


def shard_digest(manifest: Mapping[str, Any], file: str) -> str:
    """The hex digest a validated manifest records for the shard ``file``."""
    return manifest["shards"][file][digest_of(manifest)]


def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """sha256 of the manifest's own content (every key but this one, canonical JSON): the shards' hashes protect
    the weights, this protects the tables that say which bytes are which tensor (weight map, aliases, dtypes)."""
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    return hashlib.sha256(_canonical(body).encode()).hexdigest()


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_json_string = json.encoder.encode_basestring_ascii  # a str as the encoder writes it (ensure_ascii)
_TABLES = ("aliases", "tensors", "weight_map")  # a row per tensor


def _canonical(body: dict[str, Any]) -> str:
    """``json.dumps(body, sort_keys=True, separators=(",", ":"))``, the per-tensor tables written row by row:
    the encoder's key sorting makes a list for every row's dict, which at 20,000 tensors costs more than the rest
    of the checksum (it sets off the garbage collector over everything alive)."""
    if not all(type(key) is str for key in body):
        return _CANONICAL.encode(body)
    parts = []
    for key in sorted(body):
        value = body[key]
        table = _canonical_table(value) if key in _TABLES and type(value) is dict else None
        parts.append(f"{_json_string(key)}:{_CANONICAL.encode(value) if table is None else table}")
    return "{" + ",".join(parts) + "}"


def _canonical_table(table: dict[str, Any]) -> str | None:
    """A table's canonical JSON, or None (the encoder's, then) if a row is not a name or ``{"dtype", "shape"}``."""
    if not all(type(key) is str for key in table):
        return None
    rows = []
    for key in sorted(table):
        value = table[key]
        if type(value) is str:
            rows.append(f"{_json_string(key)}:{_json_string(value)}")
            continue
        if type(value) is not dict or len(value) != 2:
            return None
        dtype, shape = value.get("dtype"), value.get("shape")
        if type(dtype) is not str or type(shape) is not list or not all(type(d) is int for d in shape):
            return None
        rows.append(f'{_json_string(key)}:{{"dtype":{_json_string(dtype)},"shape":[{",".join(map(str, shape))}]}}')
    return "{" + ",".join(rows) + "}"


def validate_manifest(manifest: Any, *, source: str) -> dict[str, Any]:
    """Check a manifest's structure and internal consistency; raise ``HandoffCorruptError`` naming what is off."""

    return _validated(manifest, source=source, checksum_known=False)


def _validated(manifest: Any, *, source: str, checksum_known: bool) -> dict[str, Any]:
    """:func:`validate_manifest`; ``checksum_known``: its checksum was just computed from it (a new manifest),
    so it is not computed again."""

    def bad(what: str) -> HandoffCorruptError:
        return HandoffCorruptError(f"{source}: {what}; the handoff cannot be trusted, write it again")

    fmt = _checked_fields(manifest, source, bad, checksum_known=checksum_known)
    digest = _checked_digest(manifest, fmt, source, bad)
    _check_tables(manifest, digest, bad)
    return manifest


def _checked_fields(
    manifest: Any, source: str, bad: Callable[[str], HandoffCorruptError], *, checksum_known: bool = False
) -> str:
    """The manifest's format, once it is one this stagesafe reads, every field is there with its JSON type,
    and its checksum matches its content."""
    if not isinstance(manifest, dict):
        raise bad(f"the manifest is a JSON {type(manifest).__name__}, not an object")
    fmt = manifest.get("format")
    if fmt not in FORMATS:
        if isinstance(fmt, str) and fmt.startswith("stagesafe/"):
            raise HandoffCorruptError(
                f"{source}: format {shown(fmt)} is newer than this stagesafe reads ({', '.join(FORMATS)}); "
                "upgrade stagesafe"
            )
        raise bad(f"'format' is {shown(fmt)}, expected one of {', '.join(FORMATS)}")
    for key, kind in (
        ("created", str),
        ("shards", dict),
        ("weight_map", dict),
        ("tensors", dict),
        ("aliases", dict),
        ("total_size", int),
        ("metadata", dict),
        ("versions", dict),
    ):
        if not isinstance(manifest.get(key), kind):
            raise bad(f"'{key}' is missing or not a {kind.__name__}")
    if checksum_known:
        return fmt
    try:
        checksum = manifest_checksum(manifest)
    except RecursionError:
        raise bad("it holds JSON nested too deeply") from None
    if manifest.get("checksum") != checksum:
        raise bad("the manifest's 'checksum' does not match its content (changed after it was written)")
    return fmt


def _check_tables(manifest: Mapping[str, Any], digest: str, bad: Callable[[str], HandoffCorruptError]) -> None:
    """The shards, weight map, aliases and tensors agree: every stored name in a listed shard, every alias
    pointing to a stored name, every name described with a dtype and shape safetensors stores."""
    shards, weight_map, tensors, aliases = (manifest[k] for k in ("shards", "weight_map", "tensors", "aliases"))
    for file, rec in shards.items():
        if not is_shard_name(file):
            raise bad(f"shard name {shown(file)} is not a shard file name of this format")
        if (
            not isinstance(rec, dict)
            or not _digest.is_hexdigest(digest, rec.get(digest))
            or not isinstance(rec.get("size"), int)
            or isinstance(rec["size"], bool)
            or rec["size"] < 0
        ):
            raise bad(f"shard {file!r} needs a hex {digest!r} of its bytes and a byte 'size', got {shown(rec)}")
    for name, file in weight_map.items():
        if not isinstance(file, str) or file not in shards:
            raise bad(f"'weight_map' puts {shown(name)} in {shown(file)}, which is not listed in 'shards'")
    for alias, canonical in aliases.items():
        if alias in weight_map:
            raise bad(f"{shown(alias)} is both stored ('weight_map') and an alias")
        if not isinstance(canonical, str) or canonical not in weight_map:
            raise bad(f"alias {shown(alias)} points to {shown(canonical)}, which is not stored ('weight_map')")
    for name, meta in tensors.items():
        try:
            if not isinstance(meta, dict) or not isinstance(meta.get("shape"), list):
                raise InvalidArgumentError("not an object with a 'shape' list")
            check_tensor(name, meta.get("dtype"), meta["shape"], where="'tensors'")
        except InvalidArgumentError as exc:
            raise bad(
                f"tensor {shown(name)} needs a name, a 'dtype' and a 'shape' safetensors stores, got {shown(meta)} "
                f"({str(exc).partition(';')[0]})"
            ) from None
    described, stored = set(tensors), set(weight_map) | set(aliases)
    if described != stored:
        extra, missing = sorted(described - stored), sorted(stored - described)
        raise bad(
            f"'tensors' and 'weight_map'+'aliases' disagree: only in 'tensors': {shown(extra[:5])}, "
            f"only in the maps: {shown(missing[:5])}"
        )


def _checked_digest(manifest: Mapping[str, Any], fmt: str, source: str, bad: Any) -> str:
    """The digest the manifest's shards record: sha256 for ``stagesafe/1`` (which names none), else the one
    ``stagesafe/2`` names, which must be one this stagesafe knows."""
    if fmt == FORMATS[0]:
        if "digest" in manifest:
            raise bad(f"format {fmt!r} records sha256 and names no 'digest', but it names {shown(manifest['digest'])}")
        return _digest.LEGACY
    name = manifest.get("digest")
    if not isinstance(name, str):
        raise bad(f"'digest' is {shown(name)}, expected the name of the shards' digest, e.g. {_digest.DEFAULT!r}")
    if name not in _digest.NAMES:
        raise HandoffCorruptError(
            f"{source}: the shards' digest {shown(name)} is not one this stagesafe knows ({', '.join(_digest.NAMES)}); "
            "a newer stagesafe wrote it: upgrade stagesafe"
        )
    return name
