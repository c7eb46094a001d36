"""The examples run as users run them (Lightning spawns rank 1 itself) and print what the README promises."""

from __future__ import annotations

import os
import re

import pytest
from _launch import run_script

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

pytestmark = pytest.mark.slow


@pytest.mark.timeout(540)
def test_stage_sequence_demo(tmp_path):
    demo = os.path.join(EXAMPLES, "stage_sequence.py")
    first = run_script(demo, ["--handoff-uri", str(tmp_path / "handoff")], timeout=240)
    result = run_script(demo, ["--handoff-uri", str(tmp_path / "handoff")], timeout=240)  # again: it replaces its own
    assert first.stdout.split("\n\n")[-1] == result.stdout.split("\n\n")[-1]  # the same bits, checked the same way
    rows = {}
    for line in result.stdout.splitlines():
        cells = line.split()
        if cells and cells[0] in ("validate", "fit", "test", "predict"):
            rows[cells[0]] = cells  # stage, enter s, leave s, size and unit or -, written, clean, numel, x, dtype
            if cells[4] in ("kB", "MB"):
                cells[3:5] = [" ".join(cells[3:5])]
    assert list(rows) == ["validate", "fit", "test", "predict"]
    # Each commit line names its call and step, and the size the table shows (the same bytes, unit and rounding).
    line = r"stagesafe: handoff committed at \S+ \((\w+), step (\d+); ([\d.]+ [kM]B) in "
    committed = re.findall(line, result.stderr)
    assert [(stage, size) for stage, _, size in committed] == [(s, rows[s][3]) for s in ("validate", "fit")], committed
    quickstart = open(os.path.join(os.path.dirname(EXAMPLES), "docs", "quickstart.md")).read()
    header = next(line for line in result.stdout.splitlines() if line.startswith("stage "))
    assert header in quickstart  # the quickstart shows this table
    assert "Warning" not in result.stderr and "built successfully" not in result.stdout  # only what a user needs
    for stage, cells in rows.items():
        # the first stage writes the module's weights, fit the trained ones; test and predict change nothing
        assert cells[4] == ("yes" if stage in ("validate", "fit") else "no")
        assert cells[5] == "yes"  # the clean check passed
        assert cells[6:] == ["4096", "x", "torch.float32"]  # real weights in the original dtype
    assert "module.state_dict() == handoff, bitwise: True" in result.stdout


def test_each_checkout_has_its_own_demo_folder(tmp_path):
    """Not one fixed /tmp/stagesafe-demo shared by every checkout on the machine: a folder per checkout."""
    import importlib.util
    import shutil

    folders = []
    for checkout in ("a", "b", "a"):
        os.makedirs(tmp_path / checkout / "examples", exist_ok=True)
        copy = shutil.copy(os.path.join(EXAMPLES, "stage_sequence.py"), tmp_path / checkout / "examples")
        spec = importlib.util.spec_from_file_location(f"demo_{len(folders)}", copy)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        folders.append(module._demo_folder())
    assert folders[0] == folders[2] != folders[1]
    assert all(os.path.basename(f) == "handoff" and "stagesafe-demo-" in f for f in folders)


@pytest.mark.timeout(240)
def test_lightning_cli_class_path_example(tmp_path):
    """``python examples/lightning_cli.py fit --config examples/lightning_cli_class_path.yaml``, one override."""
    handoff = str(tmp_path / "handoff")
    result = run_script(
        os.path.join(EXAMPLES, "lightning_cli.py"),
        ["fit", "--config", os.path.join(EXAMPLES, "lightning_cli_class_path.yaml"),
         f"--trainer.strategy.init_args.handoff_uri={handoff}", f"--trainer.default_root_dir={tmp_path}"],
        timeout=200, cwd=str(tmp_path),
    )
    assert "strategy: StageSafeDeepSpeedStrategy (ZeRO stage 3, 2 ranks)" in result.stdout
    assert f"handoff: {handoff} (1 shard(s), written by 'fit' at step 8)" in result.stdout
    loss = float(result.stdout.split("test_loss:")[1].split()[0])
    assert 0 < loss < 4.62  # below chance (ln 101): test ran on the trained weights, not an empty module


@pytest.mark.timeout(240)
def test_hf_transformers_example(tmp_path):
    pytest.importorskip("transformers")
    result = run_script(
        os.path.join(EXAMPLES, "hf_transformers.py"), ["--out", str(tmp_path)], timeout=200, cwd=str(tmp_path),
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")},  # nothing may come from the Hub
    )
    assert "trained 2 steps of a 26784-parameter Llama with ZeRO-3 on 2 x cpu" in result.stdout
    assert "from_pretrained(handoff, key_mapping=...): same weights True" in result.stdout
    assert "(7 shards + config.json): same weights True" in result.stdout
    assert "same logits: True" in result.stdout
    names = sorted(os.listdir(tmp_path / "hf_model"))
    assert names[0] == "config.json" and names[1].endswith("-00001-of-00007.safetensors")


@pytest.mark.timeout(300)
def test_cloud_handoff_example_two_jobs_through_s3(s3, tmp_path):
    """Job A (2 ranks) fits and writes s3://; job B, a new process with 1 rank, resumes from it and tests."""
    script = os.path.join(EXAMPLES, "cloud_handoff.py")
    trained, tested = s3.new_url("handoff"), s3.new_url("tested")
    endpoint = ["--endpoint-url", s3.endpoint_url]
    job_a = run_script(
        script, ["train", "--handoff-uri", trained, *endpoint, "--root", str(tmp_path / "a")], timeout=200,
        cwd=str(tmp_path),
    )
    assert f"job A: fit on 2 ranks wrote {trained} at step 16" in job_a.stdout
    assert "xxh3-128-tree verified" in job_a.stdout
    assert "stagesafe.json" in s3.objects(trained)  # committed in the store, not on a local disk

    job_b = run_script(
        script, ["test", "--resume-from", trained, "--handoff-uri", tested, *endpoint, "--root", str(tmp_path / "b")],
        timeout=200, cwd=str(tmp_path),
    )
    assert f"job B: resumed from {trained} on 1 rank(s)" in job_b.stdout
    assert "module == restore(TinyLM(), handoff), bitwise: True" in job_b.stdout
    loss = float(job_b.stdout.split("test_loss ")[1].split(";")[0])
    assert loss < 3.0  # trained weights (a fresh init scores about ln(101) = 4.6)
    assert "stagesafe.json" in s3.objects(tested)
