"""The values users keep in hyperparameters, through the strategy's own checkpoints (issue 25: it refused them):
a module whose save_hyperparameters() holds paths, numpy values, datetimes, an Enum member, a dataclass, a
Namespace and a nested mix; trainer.test(ckpt_path=...) of a checkpoint written between stages and of
ModelCheckpoint's last.ckpt written during fit; then `stagesafe consolidate` and `stagesafe inspect` of both.
CPU, 2 ranks, ZeRO-3 (tests/scripts/hparams_checkpoints.py)."""

from __future__ import annotations

import json
import logging
import os

import pytest
from _launch import SCRIPTS, run_ranks

from stagesafe.cli import main
from stagesafe.handoff.read import load_state_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hparams"))
    results = run_ranks(os.path.join(SCRIPTS, "hparams_checkpoints.py"), [root], timeout=240)
    lines = results[0].stdout.splitlines()
    expected = json.loads(next(line for line in lines if line.startswith("EXPECTED "))[len("EXPECTED ") :])
    loaded = {}
    for line in lines:
        if line.startswith("LOADED "):
            _, path, described = line.split(" ", 2)
            loaded[path] = json.loads(described)
    return root, expected, loaded


def test_test_with_ckpt_path_of_either_checkpoint_gives_the_hyperparameters_saved(job):
    root, expected, loaded = job
    between, last = os.path.join(root, "between.ckpt"), os.path.join(root, "ckpts", "last.ckpt")
    assert set(loaded) == {between, last}
    for path, described in loaded.items():
        assert described == expected, path
    # the values themselves, not only their description: paths, numpy values and datetimes as saved
    assert expected["data_dir"] == ["PosixPath", os.path.join(root, "data")]
    assert expected["mask"] == ["ndarray", "int32", [[0, 1], [2, 3]]] and expected["seed"] == ["int64", 7]
    assert expected["color"] == {"class": "Color", "args": ["blue"], "attrs": {}}  # a stand-in, as described
    assert expected["optimizer"]["attrs"] == {"lr": 0.05, "betas": [0.9, 0.99]}


@pytest.mark.parametrize("which", ["between.ckpt", "ckpts/last.ckpt"])
def test_consolidate_and_inspect_read_either_checkpoint_naming_the_stand_ins(job, tmp_path, caplog, capsys, which):
    root, _, _ = job
    folder = os.path.join(root, which)
    with caplog.at_level(logging.WARNING, logger="stagesafe.zero.pickle_reader"):
        assert main(["consolidate", folder, str(tmp_path / "out"), "-q"]) == 0
        assert main(["inspect", folder]) == 0
    assert "backbone.embed.weight" in capsys.readouterr().out
    assert len(load_state_dict(str(tmp_path / "out"))) > 0
    warned = caplog.text
    assert "'__main__.Color'" in warned and "'__main__.OptimizerConfig'" in warned and "numpy" not in warned
