"""The ``stagesafe`` command: ``consolidate``, ``inspect`` and ``verify``.

``main(argv) -> int`` so that tests call it in-process. Exit codes: 0 ok; 1 a handoff failed verification, or
an error of the system or a storage backend (disk full, a read-only folder, a file-size limit, no credentials);
2 bad input (a file that is not what it claims to be, crafted or damaged, included). Errors are one line on
stderr saying what was wrong and what to do (``--traceback`` shows where an unexpected one came from).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from stagesafe.handoff.sizes import DEFAULT_MAX_SHARD_SIZE

__all__ = ["main", "run"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_CONSOLIDATE_EPILOG = """\
SRC is the folder engine.save_checkpoint(SRC) wrote (it holds 'latest' and a tag folder such as
global_step100), or the folder Lightning's trainer.save_checkpoint("x.ckpt") wrote under DeepSpeed, or a
tag folder itself. DST receives shards named model-<tag>-0000i-of-0000n.safetensors (<tag>: 8 hex digits of
this write's own, e.g. model-3f9a01c2-00001-of-00002.safetensors), model.safetensors.index.json and the
manifest stagesafe.json (the digest of every shard). Both may be local paths or fsspec URLs. With --optimizer,
DST/optimizer-<tag> receives the optimizer state the same way (tensors exp_avg/<parameter>, ...; step counts
and hyperparameters in its manifest), and DST's manifest names it: StageSafeDeepSpeedStrategy(resume_from=DST)
continues training from both on any number of ranks.

examples:
  stagesafe consolidate checkpoints/run1 weights/run1
  stagesafe consolidate lightning_logs/version_0/checkpoints/epoch=2-step=300.ckpt out --dtype bf16
  stagesafe consolidate ckpt s3://bucket/weights --tag global_step500 --max-shard-size 2GB --workers 4
  stagesafe consolidate s3://bucket/ckpt gs://bucket/weights --storage-option anon=false --overwrite
  stagesafe consolidate checkpoints/run1 s3://bucket/run1-any-world-size --optimizer
"""
_INSPECT_EPILOG = """\
URL is a stagesafe handoff (a folder with stagesafe.json) or a DeepSpeed checkpoint folder; only
metadata is read, never tensor data.

examples:
  stagesafe inspect weights/run1
  stagesafe inspect checkpoints/run1 --tag global_step100
  stagesafe inspect s3://bucket/weights --json | jq '.totals'
"""
_VERIFY_EPILOG = """\
Re-hashes every shard and compares it with the digest and size in the manifest, and checks the index (and the
same of the optimizer state in URL/optimizer-<tag>, when the manifest names it);
says which digest it checked (xxh3-128-tree, blake3, or sha256 for handoffs written before the digest was
named). Exit 0 when all match, 1 naming the first shard that does not (or an index that differs from the
manifest: loaders that follow the index would read other tensors), 2 when URL holds no handoff.
--fix-index rewrites such an index from the manifest once every shard verified.

examples:
  stagesafe verify weights/run1
  stagesafe verify weights/run1 --fix-index
  stagesafe verify s3://bucket/weights --storage-option profile=prod && echo intact
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but its usage errors are one line and exit code 2 through :func:`main`, not ``sys.exit``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


class _UsageError(Exception):
    pass


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE, e.g. anon=true or endpoint_url=http://...")
    try:
        value = json.loads(raw)  # true/false/null, numbers, JSON objects; anything else stays a string
    except ValueError:
        value = raw
    return key, value


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of workers")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``stagesafe`` parser: one subcommand each for consolidate, inspect and verify (the CLI reference in
    the docs is generated from it)."""
    parser = _Parser(
        prog="stagesafe",
        description="DeepSpeed ZeRO checkpoints to safetensors shards on any fsspec URL, and checks of the result.",
    )
    parser.add_argument(
        "--traceback", action="store_true", help="on an unexpected error, print the traceback instead of one line"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    storage = _storage_parser()
    _add_consolidate(sub, storage)
    _add_inspect(sub, storage)
    _add_verify(sub, storage)
    return parser


def _storage_parser() -> argparse.ArgumentParser:
    """The ``--storage-option`` every subcommand takes (a parent parser)."""
    storage = argparse.ArgumentParser(add_help=False)
    storage.add_argument(
        "--storage-option",
        "-o",
        dest="storage_options",
        action="append",
        type=_storage_option,
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option for the filesystems (repeatable; VALUE is parsed as JSON when it can be)",
    )
    return storage


def _add_consolidate(sub: Any, storage: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "consolidate",
        parents=[storage],
        help="write a DeepSpeed ZeRO checkpoint's weights as safetensors shards",
        description="Consolidate the fp32 weights of a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3, any world "
        "size) into safetensors shards, reading one tensor at a time.",
        epilog=_CONSOLIDATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="DeepSpeed checkpoint folder (path or URL)")
    p.add_argument("dst", metavar="DST", help="destination folder (path or URL)")
    p.add_argument("--tag", help="tag folder to read (default: the one the 'latest' file names)")
    p.add_argument(
        "--dtype",
        type=_dtype,
        metavar="DTYPE",
        help="cast floating tensors: fp32, bf16 or fp16 (or float32, bfloat16, float16, torch.bfloat16, ...; "
        "default: as saved, fp32 masters)",
    )
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help=f"largest shard, e.g. 5GB, 500MB, 2GiB (default: {DEFAULT_MAX_SHARD_SIZE})")
    p.add_argument("--exclude-frozen", action="store_true", help="leave out parameters that were not trained")
    p.add_argument(
        "--optimizer", action="store_true",
        help="also write the optimizer state per parameter into DST/optimizer-<tag> (fp32 moments, step counts and "
        "hyperparameters), so that resume_from=DST continues training at any number of ranks; weights stay fp32",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a handoff already at DST (atomically)")
    p.add_argument(
        "--workers", type=_workers, default=1, metavar="N", help="shards built and written at once (default 1)"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no summary line")


def _add_inspect(sub: Any, storage: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "inspect",
        parents=[storage],
        help="list the tensors of a handoff or of a DeepSpeed checkpoint",
        description="List tensors (name, dtype, shape, shard), totals and the manifest, without reading tensor data.",
        epilog=_INSPECT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL", help="handoff folder or DeepSpeed checkpoint folder (path or URL)")
    p.add_argument("--json", action="store_true", help="print one JSON object, for scripts")
    p.add_argument("--tag", help="for a DeepSpeed checkpoint: tag folder to describe")


def _add_verify(sub: Any, storage: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "verify",
        parents=[storage],
        help="re-hash every shard of a handoff against its manifest",
        description="Check every shard of a handoff against the digest and size its manifest records.",
        epilog=_VERIFY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL", help="handoff folder (path or URL)")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    p.add_argument("--fix-index", action="store_true", help="rewrite an index that differs from the manifest")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``stagesafe`` command line; return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(_escaped_lines(str(exc)), file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help, --version
        return int(exc.code or 0)

    from stagesafe.errors import HandoffCorruptError, HandoffNotReadyError, StageSafeError, StorageTransferError

    try:
        return {"consolidate": _consolidate, "inspect": _inspect, "verify": _verify}[args.command](args)
    except (HandoffCorruptError, HandoffNotReadyError, StorageTransferError) as exc:  # failed verification, an
        return _fail(exc, EXIT_FAILED)  # index behind its commit; the store or the disk failed
    except StageSafeError as exc:
        return _fail(exc, EXIT_USAGE)
    except (OSError, MemoryError) as exc:  # disk full, file too large, read-only: not the input, not a bug either
        return _fail(exc, EXIT_FAILED)
    except KeyboardInterrupt:
        print("stagesafe: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a storage backend's own error (credentials, ...) or a bug: one line unless asked
        if args.traceback:
            raise
        hint = _STORAGE_HINTS.get(type(exc).__name__)
        return _fail(
            exc,
            EXIT_FAILED,
            f"{type(exc).__module__}.{type(exc).__qualname__}: ",
            f"; {hint}" if hint else " (--traceback shows where)",
        )


# What to do about the errors object-store clients raise for credentials and configuration (botocore's names).
_STORAGE_HINTS = {
    "NoCredentialsError": "no credentials were found for the object store: set AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or name a profile with -o profile=NAME, or read a public bucket with -o anon=true",
    "PartialCredentialsError": "the object store's credentials are incomplete: set both AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones), or use -o profile=NAME",
    "ProfileNotFound": "that profile is not in ~/.aws/config or ~/.aws/credentials: check -o profile=NAME "
    "(or AWS_PROFILE), or leave it out to use the default credentials",
    "NoRegionError": "no region is set for the object store: pass -o client_kwargs='{\"region_name\": \"...\"}' "
    "or set AWS_DEFAULT_REGION",
    "EndpointConnectionError": "the object store's endpoint cannot be reached: check the URL, the network, or "
    "-o client_kwargs='{\"endpoint_url\": \"...\"}' for a store other than AWS",
}


def _fail(exc: BaseException, code: int, prefix: str = "", suffix: str = "") -> int:
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(_escaped(f"stagesafe: error: {prefix}{message}{suffix}"), file=sys.stderr)  # paths and names: the user's
    return code


def _consolidate(args: argparse.Namespace) -> int:
    from stagesafe.consolidate import consolidate

    manifest = consolidate(
        args.src,
        args.dst,
        tag=args.tag,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        exclude_frozen=args.exclude_frozen,
        overwrite=args.overwrite,
        storage_options=dict(args.storage_options) or None,
        workers=args.workers,
        progress=False if args.quiet else None,
        optimizer=args.optimizer,
    )
    if not args.quiet:
        source = manifest["metadata"].get("source", {})
        bound = manifest["metadata"].get("optimizer") or {}
        state = f" and the optimizer state to {args.dst.rstrip('/')}/{bound.get('folder')}" if bound else ""
        print(_escaped(
            f"wrote {len(manifest['weight_map'])} tensors ({_size(manifest['total_size'])}) in "
            f"{len(manifest['shards'])} shard{'s' if len(manifest['shards']) != 1 else ''} to {args.dst}{state} "
            f"(ZeRO-{source.get('zero_stage')}, {_count(source.get('world_size'), 'rank')}, tag {source.get('tag')})"
        ))
    return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    from stagesafe.consolidate import inspect_checkpoint

    info = inspect_checkpoint(args.url, tag=args.tag, storage_options=dict(args.storage_options) or None)
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    out = []
    if info["kind"] == "handoff":
        man = info["manifest"]
        out.append(f"handoff {info['url']} ({man['format']}, created {man['created']})")
        last = ("shard", lambda row: row.get("shard") or f"= {row['alias_of']} (tied)")
    else:
        out.append(
            f"DeepSpeed ZeRO-{info['zero_stage']} checkpoint {info['url']}, tag {info['tag']}, "
            f"{_count(info['world_size'], 'rank')}, written by deepspeed {info['deepspeed_version']}"
        )
        last = ("kind", lambda row: row.get("kind") or f"= {row['alias_of']} (tied)")
    rows = [(r["name"], r["dtype"], "[" + ", ".join(map(str, r["shape"])) + "]", last[1](r)) for r in info["tensors"]]
    out.extend(_table(("name", "dtype", "shape", last[0]), rows))
    totals = info["totals"]
    tied = f" (+{totals['aliases']} tied)" if totals["aliases"] else ""
    line = f"{totals['tensors']} tensors{tied}, {totals['elements']:,} elements, {_size(totals['bytes'])}"
    if info["kind"] == "handoff":
        line += f" in {totals['shards']} shard{'s' if totals['shards'] != 1 else ''} ({_size(totals['file_bytes'])} on disk)"
        out.append(line)
        for name, rec in man["shards"].items():
            out.append(f"  {name}  {_size(rec['size'])}  {man['digest']} {rec[man['digest']]}")
        if man["metadata"]:
            out.append("metadata: " + json.dumps(man["metadata"], sort_keys=True))
        out.append("versions: " + ", ".join(f"{k} {v}" for k, v in man["versions"].items() if v))
    else:
        kinds = totals["by_kind"]
        out.append(
            f"{line} ({kinds['param']:,} trained, {kinds['frozen']:,} frozen, {kinds['buffer']:,} buffer elements)"
        )
    print(_escaped_lines("\n".join(out)))  # names come from the file
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from stagesafe.storage.fs import join, resolve
    from stagesafe.errors import HandoffNotFoundError
    from stagesafe.handoff.manifest import digest_of
    from stagesafe.publishing.verify import verify

    options = dict(args.storage_options) or None
    try:
        manifest = verify(args.url, storage_options=options, fix_index=args.fix_index,
                          progress=False if args.quiet else None)
    except HandoffNotFoundError as exc:
        fs, root = resolve(args.url, options)
        if fs.isfile(join(root, "latest")):
            raise HandoffNotFoundError(
                f"no handoff at {args.url!r}: it is a DeepSpeed checkpoint, which has no manifest to verify against; "
                f"consolidate it (stagesafe consolidate {args.url} DST), then verify DST"
            ) from exc
        raise
    if not args.quiet:
        size = sum(rec["size"] for rec in manifest["shards"].values())
        n = len(manifest["shards"])
        state = " and the optimizer state beside it, which these weights name" if "optimizer" in manifest[
            "metadata"] else ""
        print(_escaped(
            f"ok: {n} shard{'s' if n != 1 else ''} ({_size(size)}) match the manifest of {args.url} "
            f"(digest {digest_of(manifest)}){state}"
        ))
    return EXIT_OK


def _dtype(value: str) -> str:
    from stagesafe.consolidate import DTYPES

    key = value.lower().removeprefix("torch.")
    if key not in DTYPES:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of fp32, bf16, fp16 (or float32, bfloat16, float16)")
    return key


def _count(n: object, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _escaped(text: str) -> str:
    """``text`` with what a terminal would act on (escape sequences, bell, carriage return, ...) shown escaped:
    names come from the file, and a crafted one must not rewrite the screen."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _escaped_lines(text: str) -> str:
    """:func:`_escaped`, line by line: a message of several lines keeps its line breaks."""
    return "\n".join(_escaped(line) for line in text.split("\n"))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    return [fmt.format(*header), *(fmt.format(*row) for row in rows)]


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def run() -> NoReturn:
    """The console entry point: :func:`main`, then exit without the interpreter's teardown, which takes 0.2-0.4 s
    once torch is loaded and has nothing left to do (every file is written, fsynced and closed by then)."""
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: the exit code still tells
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
