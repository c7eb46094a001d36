"""Continue training exactly on another number of ranks: ``fit(ckpt_path=...)`` of a ZeRO checkpoint written by N
ranks, on M ranks, through stagesafe's own reader (tests/scripts/world_size.py).

CPU ranks, bf16-mixed, AdamW with weight decay and a step-wise lr schedule. A fit of one epoch on N ranks records,
while its engine lives, the full fp32 masters and Adam moments (DeepSpeed's ``safe_get_full_*``), then saves the
checkpoint; a new process on M ranks resumes from it and records the same when training starts, before any step:
every tensor is compared bitwise. Then what cannot be resumed is refused on every rank, naming what differs, and a
checkpoint whose pickles carry code is refused at any world size with nothing run.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from _launch import SCRIPTS, run_script

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]

SCRIPT = os.path.join(SCRIPTS, "world_size.py")
SAMPLES, BATCH = 32, 4  # tests/scripts/toy.py's dataloader

# (ZeRO stage, ranks that saved, ranks that resume, who saved: stagesafe's strategy or stock Lightning's)
CASES = {
    "z2-2to1": (2, 2, 1, "stagesafe"),
    "z2-2to3": (2, 2, 3, "stagesafe"),
    "z3-2to1": (3, 2, 1, "stagesafe"),
    "z3-2to3": (3, 2, 3, "stagesafe"),
    "z3-4to2": (3, 4, 2, "stagesafe"),
    "z2-3to4": (2, 3, 4, "stagesafe"),
    "z3-stock-2to1": (3, 2, 1, "stock"),
    "z2-stock-2to3": (2, 2, 3, "stock"),
    "z3-frozen-2to3": (3, 2, 3, "stagesafe-frozen"),  # a frozen layer: ZeRO-3 partitions it, re-partitioned too
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("world-size"))


@functools.cache
def _saved(root: str, stage: int, ranks: int, writer: str) -> str:
    out = os.path.join(root, f"z{stage}-{writer}-{ranks}")
    run_script(SCRIPT, ["save", out, str(stage), str(ranks), writer], timeout=600, cwd=root)
    return out


@functools.cache
def _resumed(root: str, case: str) -> str:
    stage, saved, resumed, writer = CASES[case]
    out = _saved(root, stage, saved, writer)
    run_script(SCRIPT, ["resume", out, str(stage), str(resumed), writer], timeout=600, cwd=root)
    return out


def _tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(path)


def _json(path: str):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("case", list(CASES))
def test_masters_and_moments_on_the_new_ranks_equal_those_saved_bitwise(root, case):
    """After the resume, before any step, the M ranks' engine holds every fp32 master and both Adam moments
    exactly as the N ranks' engine held them when the checkpoint was saved; the step count and lr too."""
    stage, _, resumed, _ = CASES[case]
    out = _resumed(root, case)
    saved, now = _tensors(f"{out}/saved.safetensors"), _tensors(f"{out}/resumed-{resumed}.safetensors")
    assert set(now) == set(saved) and {n.split("/")[0] for n in saved} == {"master", "exp_avg", "exp_avg_sq"}
    for name, value in saved.items():
        assert now[name].dtype == value.dtype == torch.float32 and now[name].shape == value.shape, name
        assert torch.equal(now[name].view(torch.uint8), value.view(torch.uint8)), f"{name} differs"
    assert any(v.abs().sum() > 0 for n, v in saved.items() if n.startswith("exp_avg/"))  # the moments are real
    facts, facts_now = _json(f"{out}/saved.json"), _json(f"{out}/resumed-{resumed}.json")
    assert facts_now == facts and facts["steps"] == [float(facts["global_step"])]


@pytest.mark.parametrize("case", ["z2-2to1", "z3-2to3", "z3-4to2"])
def test_training_continues_from_the_saved_step(root, case):
    """The second epoch runs on M ranks from the saved step: as many steps as M ranks take for an epoch, finite
    losses, and new weights."""
    _, _, resumed, _ = CASES[case]
    out = _resumed(root, case)
    after, saved = _json(f"{out}/after-{resumed}.json"), _json(f"{out}/saved.json")
    per_rank = math.ceil(SAMPLES / resumed)  # the distributed sampler pads to a multiple of the ranks
    assert after["global_step"] == saved["global_step"] + math.ceil(per_rank / BATCH)
    losses = [loss for rank in after["losses"] for loss in rank]
    assert losses and all(math.isfinite(loss) for loss in losses)
    weights, masters = _tensors(f"{out}/after-{resumed}.safetensors"), _tensors(f"{out}/saved.safetensors")
    assert not torch.equal(weights["backbone.head.weight"], masters["master/backbone.head.weight"])


def test_frozen_parameters_are_re_partitioned_and_stay_as_saved(root):
    """ZeRO-3 keeps each rank's fragment of a frozen parameter in its model states: on 3 ranks they come back
    whole, so the handoff of the resumed fit holds them as the 2 ranks saved them."""
    out = _resumed(root, "z3-frozen-2to3")
    saved, after = _tensors(f"{out}/saved.safetensors"), _tensors(f"{out}/after-3.safetensors")
    assert not any("hidden" in n for n in saved)  # frozen: no master, no moments
    from stagesafe import load_state_dict

    before = load_state_dict(f"{out}/saved-handoff")
    for name in ("backbone.hidden.weight", "backbone.hidden.bias"):
        assert torch.equal(after[name].view(torch.uint8), before[name].view(torch.uint8)), name
    assert not torch.equal(after["backbone.head.weight"], before["backbone.head.weight"])  # the rest trained


@pytest.fixture(scope="module")
def refusals(root) -> str:
    """The ZeRO-3 checkpoint of 2 ranks, resumed as it cannot be (see tests/scripts/world_size.py ``refuse``),
    and a copy whose rank 1 optimizer file carries a payload that creates ``pwned`` when unpickled."""
    out = _saved(root, 3, 2, "stagesafe")
    for name, marker in (("crafted", "pwned"), ("crafted-stock", "pwned-by-stock")):
        crafted = os.path.join(out, name)
        shutil.copytree(os.path.join(out, "ckpt"), crafted)
        (target,) = glob.glob(os.path.join(crafted, "checkpoint", "*zero_pp_rank_1_*optim_states.pt"))
        states = torch.load(target, weights_only=False)
        states["optimizer_state_dict"]["payload"] = _Touch(os.path.join(out, marker))
        torch.save(states, target)
    variants = (("payload", 1), ("payload", 2), ("extra", 1), ("sgd", 1), ("stage2", 2), ("payload-stock", 2))
    for variant, ranks in variants:
        run_script(SCRIPT, ["refuse", out, "3", str(ranks), variant], timeout=600, cwd=root)
    return out


class _Touch:
    """Creates ``path`` when unpickled by a loader that runs what a pickle names (torch.load(weights_only=False))."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_checkpoint_whose_pickles_carry_code_is_refused_at_any_world_size(refusals, ranks):
    """fit(ckpt_path=) reads the rank files as test(ckpt_path=) does: the payload is refused, nothing ran, no
    step was taken; with the world size unchanged (2) and changed (1)."""
    error = _json(f"{refusals}/refused-payload-{ranks}.json")
    assert error["type"] == "UnsafeCheckpointError" and error["steps"] == 0
    assert "posix.system" in error["message"] and "nothing from the file was executed" in error["message"]
    assert not os.path.exists(os.path.join(refusals, "pwned"))
    assert os.path.exists(os.path.join(refusals, "pwned-by-stock"))  # the payload is live: stock Lightning ran it


@pytest.mark.parametrize(
    ("variant", "ranks", "says"),
    [
        ("extra", 1, ["StateDictMismatchError", "does not hold this model's trained parameters", "extra_head.weight"]),
        ("sgd", 1, ["CheckpointFormatError", "another optimizer than this SGD", "'momentum'", "'betas'"]),
        ("stage2", 2, ["CheckpointFormatError", "ZeRO stage 3", "runs stage 2"]),
    ],
)
def test_what_cannot_be_resumed_is_refused_naming_what_differs(refusals, variant, ranks, says):
    """Never a silent restart: a model with another layer, another optimizer, another ZeRO stage."""
    error = _json(f"{refusals}/refused-{variant}-{ranks}.json")
    assert error["type"] == says[0] and error["steps"] == 0
    for part in says[1:]:
        assert part in error["message"], error["message"]


# -- a checkpoint of plain DeepSpeed (engine.save_checkpoint): a tied weight, a frozen layer, two param groups ------

PLAIN = os.path.join(SCRIPTS, "plain_resume.py")


@functools.cache
def _plain(root: str, stage: int, dtype: str, saved: int, resumed: tuple[int, ...]) -> str:
    from _launch import run_ranks

    out = os.path.join(root, f"plain-z{stage}-{dtype}-{saved}")
    os.makedirs(out)
    args = [out, str(stage), "--dtype", dtype]
    run_ranks(PLAIN, ["save", *args], world_size=saved, timeout=300, cwd=root)
    for ranks in resumed:
        run_ranks(PLAIN, ["ours", *args], world_size=ranks, timeout=300, cwd=root)
    run_ranks(PLAIN, ["stock", *args], world_size=saved, timeout=300, cwd=root)
    from stagesafe.cli import main

    assert main(["consolidate", "--optimizer", "-q", f"{out}/ckpt", f"{out}/form"]) == 0
    for ranks in resumed:
        run_ranks(PLAIN, ["form", *args], world_size=ranks, timeout=300, cwd=root)
    return out


@pytest.mark.parametrize("resumed", [1, 2, 3])
@pytest.mark.parametrize(("stage", "dtype"), [(3, "fp32"), (2, "fp32"), (1, "fp32"), (1, "bf16")])
def test_a_plain_deepspeed_checkpoint_resumes_on_another_world_size(root, stage, dtype, resumed):
    """Masters and moments of both param groups, the tied weight's once, and the frozen layer come back bitwise;
    the engine then steps. At the world size that saved, they equal what DeepSpeed's own load gives. ZeRO-1
    under bf16 is DeepSpeed's BF16_Optimizer, whose partitions are laid out its own way. The same through
    `stagesafe consolidate --optimizer`'s handoff (``form``), which knows no world size."""
    saved = 2
    out = _plain(root, stage, dtype, saved, (1, 2, 3))
    expected = _tensors(f"{out}/saved.safetensors")
    assert any(n.startswith("frozen/") for n in expected) and "master/embed.weight" in expected
    for other in (f"{out}/ours-{resumed}.safetensors", f"{out}/stock-{saved}.safetensors",
                  f"{out}/form-{resumed}.safetensors"):
        got = _tensors(other)
        assert set(got) == set(expected), other
        for name, value in expected.items():
            assert torch.equal(got[name].view(torch.uint8), value.view(torch.uint8)), f"{other}: {name} differs"


# -- the world-size-free form: `stagesafe consolidate --optimizer`, then resume_from= on another number of ranks ----

# (ZeRO stage, ranks that saved, ranks that resume, where the handoff lies)
FORM_CASES = {
    "z2-2to1": (2, 2, 1, "local"),
    "z2-2to3": (2, 2, 3, "local"),
    "z3-2to1": (3, 2, 1, "local"),
    "z3-2to3": (3, 2, 3, "local"),
    "z3-2to3-s3": (3, 2, 3, "s3"),
    "z2-2to1-s3": (2, 2, 1, "s3"),
    "z3-2to1-validate-first": (3, 2, 1, "local"),  # a validate call first: the first fit still continues the state
    "z2-2to3-validate-here": (2, 2, 3, "local"),  # the same, its handoff written where it resumed from
}


def _consolidated(request, out: str, where: str) -> tuple[str, dict | None]:
    """The checkpoint OUT/ckpt consolidated with its optimizer state by the command, on local disk or on the
    loopback S3 server; (url, storage options)."""
    from stagesafe.cli import main

    if where == "s3":
        s3 = request.getfixturevalue("s3")
        url, options = s3.new_url("form"), s3.storage_options()
        argv = [f"--storage-option={k}={json.dumps(v)}" for k, v in options.items()]
    else:
        url, options, argv = os.path.join(out, "form"), None, []
    if where == "s3" or not os.path.exists(url):
        assert main(["consolidate", "--optimizer", "-q", f"{out}/ckpt", url, *argv]) == 0
    return url, options


def _from_form(root: str, out: str, stage: int, ranks: int, url: str, options: dict | None, name: str) -> None:
    env = {"STAGESAFE_TEST_STORAGE": json.dumps(options), "STAGESAFE_TEST_RECORD": name}
    run_script(SCRIPT, ["form", out, str(stage), str(ranks), url], timeout=600, cwd=root, env=env)


@pytest.mark.parametrize("case", list(FORM_CASES))
def test_resume_from_a_consolidated_handoff_continues_the_optimizer_bitwise(root, request, case):
    """The handoff of `stagesafe consolidate --optimizer` (the checkpoint of 2 ranks) resumed with resume_from=
    on M ranks: before the first step the engine holds every fp32 master, both Adam moments and the step count
    exactly as the 2 ranks' engine held them; then the fit trains (a handoff of new weights)."""
    stage, saved, resumed, where = FORM_CASES[case]
    out = _saved(root, stage, saved, "stagesafe")
    url, options = _consolidated(request, out, where)
    if case.endswith("-here"):  # this case writes into the handoff it resumes from: a copy of its own
        shutil.copytree(url, f"{url}-{case}")
        url = f"{url}-{case}#validate-here"
    elif "validate" in case:
        url += "#validate"
    _from_form(root, out, stage, resumed, url, options, f"form-{case}")
    expected, now = _tensors(f"{out}/saved.safetensors"), _tensors(f"{out}/form-{case}.safetensors")
    assert set(now) == set(expected)
    for name, value in expected.items():
        assert torch.equal(now[name].view(torch.uint8), value.view(torch.uint8)), f"{name} differs"
    assert _json(f"{out}/form-{case}.json")["steps"] == _json(f"{out}/saved.json")["steps"]
    from stagesafe import load_state_dict

    after = load_state_dict(url.partition("#")[0] if case.endswith("-here") else f"{out}/form-{case}-handoff")
    assert not torch.equal(after["backbone.head.weight"], expected["master/backbone.head.weight"])  # it trained
    if case.endswith("-here"):  # the trained weights replaced the resumed ones there, and their state went with them
        from stagesafe.handoff.optimizer_state import open_form

        assert open_form(url.partition("#")[0]) is None
        assert not [d for d in os.listdir(url.partition("#")[0]) if d.startswith("optimizer-")]


@pytest.mark.parametrize(
    ("variant", "says"),
    [
        ("frozen", ["StateDictMismatchError", "does not hold this model's trained parameters",
                    "held but not trained by this model", "backbone.hidden.bias"]),
        ("sgd", ["CheckpointFormatError", "another optimizer than this SGD", "'momentum'", "'betas'"]),
        ("missing", ["StateDictMismatchError", "does not hold this model's trained parameters",
                     "missing", "backbone.head.bias"]),
    ],
)
def test_what_the_form_cannot_resume_is_refused_naming_what_differs(root, variant, says):
    """Never a silent restart of the optimizer: a model that trains other parameters, another optimizer, and a
    state (written by hand) that lacks a parameter are refused on every rank before any step."""
    from stagesafe import load_state_dict, read_manifest, save_state_dict
    from stagesafe.handoff.optimizer_state import binding, bound_folder

    out = _saved(root, 3, 2, "stagesafe")
    url, _ = _consolidated(None, out, "local")
    if variant == "missing":  # the same handoff without the state of one parameter, bound again
        url = os.path.join(out, "form-missing")
        if not os.path.exists(url):
            shutil.copytree(os.path.join(out, "form"), url)
            weights = read_manifest(url)
            folder = bound_folder(weights)
            metadata = json.loads(json.dumps(read_manifest(f"{url}/{folder}")["metadata"]))
            for group in metadata["optimizer_state"]["param_groups"]:
                group["params"] = [p for p in group["params"] if p != "backbone.head.bias"]
            tensors = {k: v for k, v in load_state_dict(f"{url}/{folder}").items() if not k.endswith("head.bias")}
            rebound = save_state_dict(tensors, f"{url}/{folder}", overwrite=True, metadata=metadata)
            save_state_dict(load_state_dict(url), url, overwrite=True,
                            metadata={**weights["metadata"], "optimizer": binding(folder, rebound)})
    module_variant = "" if variant == "missing" else variant
    _from_form(root, out, 3, 1, f"{url}#{module_variant or 'plain'}", None, f"form-{variant}")
    error = _json(f"{out}/form-refused-{module_variant or 'plain'}-1.json")
    assert error is not None and error["type"] == says[0] and error["steps"] == 0, error
    for part in says[1:]:
        assert part in error["message"], error["message"]


# -- the same form written by the strategy at a fit's end: StageSafeDeepSpeedStrategy(handoff_optimizer_state=True) --


@pytest.mark.parametrize("stage", [2, 3])
def test_a_fit_hands_off_its_optimizer_state_as_consolidate_writes_it(root, stage):
    """A fit of 2 ranks with the argument on: its handoff holds the optimizer state beside the weights, equal
    bitwise to what the engine held at the fit's end (masters in the weights, both moments in the state) and to
    `stagesafe consolidate --optimizer` of the checkpoint saved after the fit; the same JSON; `verify` passes."""
    from stagesafe import load_state_dict
    from stagesafe.cli import main
    from stagesafe.handoff.optimizer_state import open_form

    out = _saved(root, stage, 2, "stagesafe-state")
    handoff = f"{out}/saved-handoff"
    assert main(["verify", "-q", handoff]) == 0
    form = open_form(handoff)
    assert form is not None and form.keys == ("exp_avg", "exp_avg_sq")
    state, weights = load_state_dict(form.url), load_state_dict(handoff)
    captured = _tensors(f"{out}/saved.safetensors")
    assert {n for n in captured if not n.startswith("master/")} == set(state)
    for name, value in captured.items():
        key, _, parameter = name.partition("/")
        got = weights[parameter] if key == "master" else state[name]
        assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), f"{name} differs"
    consolidated = os.path.join(out, "consolidated")
    if not os.path.exists(consolidated):
        assert main(["consolidate", "--optimizer", "-q", f"{out}/ckpt", consolidated]) == 0
    reference = open_form(consolidated)
    expected = load_state_dict(reference.url)
    assert set(expected) == set(state)
    for name, value in expected.items():
        assert torch.equal(state[name].view(torch.uint8), value.view(torch.uint8)), f"{name} differs"
    assert [(sorted(g.params), g.hyperparameters, g.state) for g in form.groups] == [
        (sorted(g.params), g.hyperparameters, g.state) for g in reference.groups]
    assert form.loss_scaler == reference.loss_scaler
    assert form.groups[0].state["step"]["value"] == float(_json(f"{out}/saved.json")["global_step"])
    assert form.source["world_size"] == 2 and form.source["zero_stage"] == stage


@pytest.mark.parametrize(("stage", "resumed"), [(2, 1), (2, 3), (3, 1), (3, 3)])
def test_resume_from_the_handoff_of_a_fit_continues_its_optimizer_bitwise(root, stage, resumed):
    """That handoff resumed with resume_from= on 1 and 3 ranks: before the first step the engine holds every fp32
    master, both Adam moments and the step count exactly as the 2 ranks' engine held them at the fit's end."""
    out = _saved(root, stage, 2, "stagesafe-state")
    name = f"fit-form-{resumed}"
    _from_form(root, out, stage, resumed, f"{out}/saved-handoff", None, name)
    expected, now = _tensors(f"{out}/saved.safetensors"), _tensors(f"{out}/{name}.safetensors")
    assert set(now) == set(expected)
    for tensor, value in expected.items():
        assert torch.equal(now[tensor].view(torch.uint8), value.view(torch.uint8)), f"{tensor} differs"
    assert _json(f"{out}/{name}.json")["steps"] == _json(f"{out}/saved.json")["steps"]


def test_fit_test_fit_leaves_one_state_bound_and_other_weights_none(root):
    """fit -> test -> fit under the argument: after each call one optimizer folder, the one the weights name, and
    `verify` passes; the second fit's state replaced the first's. Weights changed by hand, then written by a
    test call, name no state, and the last one is deleted with the weights it belonged to."""
    out = os.path.join(root, "sequence")
    run_script(SCRIPT, ["sequence", out, "3", "2"], timeout=600, cwd=root)
    fit, test, again, changed = _json(f"{out}/sequence.json")
    assert [s["call"] for s in (fit, test, again, changed)] == ["fit", "test", "fit-again", "test-changed"]
    for step in (fit, test, again):
        assert len(step["folders"]) == 1 and step["bound"] == step["folders"][0] and step["verify"] == 0, step
    assert test["bound"] == fit["bound"] and again["bound"] != fit["bound"]
    assert changed == {"call": "test-changed", "folders": [], "bound": None, "verify": 0}
