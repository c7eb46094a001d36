"""Scripts that end right after ``fit``, many rounds: is the trained handoff always committed, and does a write
that fails always fail the process?

    DS_ACCELERATOR=cpu python benchmarks/rounds_end_after_fit.py --rounds 20 [--only local s3 refused]

Each round is a real 2-rank Lightning job on CPU (one process per rank, as torchrun starts them) running
tests/scripts/end_after_fit.py, which fits 3 steps and ends while its handoff is still being written:
- local: the handoff on a local folder; after both processes exit it must hold the trained weights, bitwise;
- s3: the same through s3:// on a moto server on loopback, then a second job resumes from it and must see them;
- refused: the S3 server refuses the shards (403): both processes must exit 1, nothing may be committed.
Prints one line per round and a summary; exits 1 if any round went wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "scripts"))

from _launch import LaunchError, run_ranks  # noqa: E402

SCRIPT = os.path.join(HERE, "..", "tests", "scripts", "end_after_fit.py")


def job(spec: dict):
    os.makedirs(spec["root"], exist_ok=True)
    try:
        return run_ranks(SCRIPT, [json.dumps(spec)], timeout=300, cwd=spec["root"]), None
    except LaunchError as failed:
        return failed.results, failed


def printed(result, key: str) -> str | None:
    return next((line.split()[1] for line in result.stdout.splitlines() if line.startswith(key + " ")), None)


def round_local(root: str) -> str:
    import stagesafe
    from toy import state_digest_of

    uri = os.path.join(root, "handoff")
    results, failed = job({"mode": "fit", "root": root, "handoff_uri": uri})
    if failed:
        return f"FAILED: the job failed ({[r.returncode for r in results]})"
    same = state_digest_of(stagesafe.load_state_dict(uri)) == printed(results[0], "DIGEST")
    return "ok" if same else "FAILED: the committed handoff is not the trained module"


def round_s3(root: str, server) -> str:
    uri, options = server.new_url("rounds"), server.storage_options()
    results, failed = job({"mode": "fit", "root": root + "/a", "handoff_uri": uri, "storage_options": options})
    if failed:
        return f"FAILED: the job failed ({[r.returncode for r in results]})"
    later, failed = job({"mode": "resume", "root": root + "/b", "handoff_uri": root + "/b/h", "resume_from": uri,
                         "storage_options": options})
    if failed:
        return f"FAILED: the resuming job failed ({[r.returncode for r in later]})"
    same = printed(later[0], "TESTED") == printed(results[0], "DIGEST")
    return "ok" if same else "FAILED: the later job did not resume from the trained weights"


def round_refused(root: str, server) -> str:
    uri = server.new_url("refused")
    server.fail("PUT", r"/model-[0-9a-f]{8}-", 403, "AccessDenied")
    try:
        results, _ = job({"mode": "fit", "root": root, "handoff_uri": uri, "storage_options": server.storage_options()})
    finally:
        server.clear_rules()
    codes = [r.returncode for r in results]
    committed = "stagesafe.json" in server.objects(uri)
    if codes != [1, 1] or committed:
        return f"FAILED: exit statuses {codes}, committed {committed}"
    return "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--only", nargs="+", default=["local", "s3", "refused"])
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from _s3 import running_server

    outcomes: dict[str, list[str]] = {kind: [] for kind in args.only}
    with running_server() as server, tempfile.TemporaryDirectory(prefix="stagesafe-rounds-") as base:
        for n in range(args.rounds):
            for kind in args.only:
                started = time.perf_counter()
                root = os.path.join(base, f"{kind}-{n}")
                if kind == "local":
                    outcome = round_local(root)
                elif kind == "s3":
                    outcome = round_s3(root, server)
                else:
                    outcome = round_refused(root, server)
                outcomes[kind].append(outcome)
                print(f"round {n + 1:2d} {kind:8s} {outcome} ({time.perf_counter() - started:.1f} s)", flush=True)
    print()
    bad = 0
    for kind, results in outcomes.items():
        good = results.count("ok")
        bad += len(results) - good
        print(f"{kind:8s} {good} of {len(results)} rounds ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
