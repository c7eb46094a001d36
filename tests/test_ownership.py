"""A handoff belongs to the run that wrote it: jobs that follow on one folder, each a new 2-rank process.

Job A fits and leaves its handoff in the default folder. Job B (``test`` with a ``ckpt_path`` that does not
exist) and job C (a plain ``test``), new processes with fresh modules, leave it bitwise as it was: B fails
before any step and writes nothing; C writes to a versioned folder of its own, and rank 0 says where. A ``handoff_uri`` named by the user that holds another
run's handoff is refused on every rank before any step; ``resume_from`` it, or ``overwrite_handoff=True``,
makes it this run's.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from _launch import run_recorded

from stagesafe.stages.ownership import versioned

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "ownership.py")

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def _job(job: str, root, handoff: str | None = None, *, expect_ok: bool = True):
    args = [job, str(root)] + ([handoff] if handoff else [])
    results, records = run_recorded(SCRIPT, args, timeout=180, cwd=str(root), expect_ok=expect_ok)
    return results, [rank[0] for rank in records]


def _bytes_of(folder: str) -> dict[str, str]:
    """Every file of the folder, by name, with the sha256 of its bytes."""
    return {
        name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()  # noqa: SIM115
        for name in sorted(os.listdir(folder))
    }


def _written_folders(root) -> set[str]:
    """The handoff folders under ``root`` that hold any file."""
    return {name for name in os.listdir(root)
            if name.startswith("stagesafe_handoff") and os.path.isdir(root / name) and os.listdir(root / name)}


def test_jobs_that_follow_on_the_default_folder_never_replace_another_runs_handoff(tmp_path):
    default = str(tmp_path / "stagesafe_handoff")
    _, a = _job("fit", tmp_path)
    assert [r["uri"] for r in a] == [default] * 2 and a[0]["error"] is None
    trained = _bytes_of(default)
    results, b = _job("bad_ckpt", tmp_path, expect_ok=False)
    assert all(r["error"] is not None and "FileNotFoundError" in r["error"]["mro"] for r in b)
    assert _bytes_of(default) == trained  # the old tree: B's untrained weights committed over A's
    assert _written_folders(tmp_path) == {"stagesafe_handoff"}  # B failed before any step: it wrote nothing
    _, c = _job("test", tmp_path)
    assert _bytes_of(default) == trained
    assert c[0]["error"] is None
    assert [r["uri"] for r in c] == [versioned(default, 1)] * 2
    # a re-run of the same script works, beside the others, and says where it writes
    results, again = _job("fit", tmp_path)
    assert again[0]["error"] is None and again[0]["uri"] not in (default, c[0]["uri"])
    assert f"this run's handoff is written to {again[0]['uri']}" in results[0].stderr + results[0].stdout
    assert _bytes_of(default) == trained


def test_a_named_folder_holding_another_runs_handoff_is_refused_on_every_rank_until_resumed_or_overwritten(tmp_path):
    named = str(tmp_path / "weights")
    _job("fit", tmp_path, named)
    trained = _bytes_of(named)
    _, refused = _job("fit", tmp_path, named)
    for record in refused:
        assert record["error"]["type"] == "HandoffExistsError", record
        message = record["error"]["message"]
        assert "from fit" in message and "step 4" in message and "committed 20" in message, message
        assert "resume_from=" in message and "another handoff_uri" in message and "overwrite_handoff=True" in message
        assert record["global_step"] == 0  # before any step
    assert _bytes_of(named) == trained
    _, resumed = _job("resume", tmp_path, named)
    assert all(r["error"] is None and r["uri"] == named for r in resumed) and resumed[0]["global_step"] == 4
    assert _bytes_of(named) != trained
    _, replaced = _job("overwrite", tmp_path, named)
    assert all(r["error"] is None and r["uri"] == named for r in replaced)
