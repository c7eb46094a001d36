"""A failure on one rank surfaces on every rank, with each rank's reason, instead of hanging the others."""

from __future__ import annotations

import json
import os

import pytest
from _launch import run_ranks

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "dist_outcomes.py")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_errors_reach_every_rank(tmp_path):
    run_ranks(SCRIPT, [str(tmp_path / "out")], world_size=2, timeout=90)
    rank0, rank1 = (json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1))
    # rank 1 failed: it re-raises its own error; rank 0 learns of it, naming the rank and the reason
    assert rank1["all_ranks"] == {"error": "OSError", "message": "disk full on rank 1"}
    assert rank0["all_ranks"]["error"] == "DistributedStageError"
    assert "writing shards failed on 1 rank(s): rank 1: OSError: disk full on rank 1" in rank0["all_ranks"]["message"]
    # rank 0 failed alone: rank 1 is told instead of waiting
    assert rank0["on_rank_zero"]["error"] == "PermissionError"
    assert rank1["on_rank_zero"]["error"] == "DistributedStageError"
    assert "publishing the handoff failed on rank 0: PermissionError: read-only folder" in rank1["on_rank_zero"]["message"]
    assert rank0["ok"] == {"result": 0} and rank1["ok"] == {"result": 1}
