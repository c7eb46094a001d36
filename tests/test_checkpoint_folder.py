"""Where a ZeRO checkpoint's rank files are (stagesafe/zero/checkpoint_folder.py), on folders of empty files named as
DeepSpeed names them: only names are read here, and ``latest``. What was passed instead of a checkpoint is said
with what to pass. The same errors through the reader, on real DeepSpeed checkpoints: tests/test_zero_checkpoint.py.
"""

from __future__ import annotations

import os
import re

import pytest

from stagesafe.errors import CheckpointFormatError
from stagesafe.storage.fs import resolve
from stagesafe.zero.checkpoint import open_zero_checkpoint
from stagesafe.zero.checkpoint_folder import RankFileNames, TagFolder, locate, rank_file_names

pytestmark = pytest.mark.timeout(60)

Z3 = ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
      "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
Z12 = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
       "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def _folder(root, files: dict[str, str | None]) -> str:
    """Files (relative path -> content; None: a rank file's name, empty) under ``root``; returns ``root``."""
    for name, content in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content or "")
    return str(root)


def _checkpoint(root, *tags: str, latest: str | None = None) -> str:
    files: dict[str, str | None] = {f"{tag}/{name}": None for tag in tags for name in Z3}
    if latest is not None:
        files["latest"] = latest
    return _folder(root, files)


def _locate(path: str, tag: str | None = None) -> TagFolder:
    fs, root = resolve(path)
    return locate(fs, root, tag)


def test_not_a_checkpoint_says_what_was_expected(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        CheckpointFormatError, match=r"is not a DeepSpeed checkpoint: expected a folder with a 'latest'"
    ):
        open_zero_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(CheckpointFormatError, match="does not exist"):
        open_zero_checkpoint(str(tmp_path / "nowhere"))
    (tmp_path / "weights.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointFormatError, match="is a file, not a DeepSpeed checkpoint folder"):
        open_zero_checkpoint(str(tmp_path / "weights.ckpt"))


def test_latest_names_the_tag_folder_and_lightnings_is_called_checkpoint(tmp_path):
    deepspeed = _checkpoint(tmp_path / "ds", "global_step1", "global_step2", latest="global_step1\n")
    assert _locate(deepspeed) == TagFolder("global_step1", os.path.join(deepspeed, "global_step1"), "deepspeed")
    assert _locate(deepspeed, "global_step2").tag == "global_step2"  # the tag asked for wins
    lightning = _checkpoint(tmp_path / "x.ckpt", "checkpoint", latest="checkpoint")
    assert _locate(lightning) == TagFolder("checkpoint", os.path.join(lightning, "checkpoint"), "lightning")


def test_the_tag_folder_itself_is_read_as_one_and_a_tag_with_it_is_refused(tmp_path):
    path = _checkpoint(tmp_path / "ckpt", "global_step3", latest="global_step3")
    tag_dir = os.path.join(path, "global_step3")
    assert _locate(tag_dir) == TagFolder("global_step3", tag_dir, "tag-folder")
    parent = re.escape(path)
    with pytest.raises(CheckpointFormatError, match=f"is itself a tag folder .* pass its parent '{parent}' with --tag"):
        _locate(tag_dir, "global_step3")


@pytest.mark.parametrize("tag", ["", "a/b", "..", ".", "a\\b"])
def test_a_tag_that_is_not_a_folder_name_is_refused(tmp_path, tag):
    path = _checkpoint(tmp_path / "ckpt", "global_step1", latest="global_step1")
    with pytest.raises(CheckpointFormatError, match="is not a tag folder name; give the name alone"):
        _locate(path, tag)


def test_without_latest_the_tags_are_listed_in_the_order_of_their_steps(tmp_path):
    path = _checkpoint(tmp_path / "ckpt", "global_step10", "global_step9", "global_step100")
    (tmp_path / "ckpt" / "logs").mkdir()  # a folder without rank files is no tag
    listed = r"\['global_step9', 'global_step10', 'global_step100'\]"
    with pytest.raises(CheckpointFormatError, match=rf"no 'latest' file .* pass a tag .* with one of {listed}"):
        _locate(path)
    found = _locate(path, "global_step10")
    assert found == TagFolder("global_step10", os.path.join(path, "global_step10"), "deepspeed")
    with pytest.raises(CheckpointFormatError, match=rf"no tag folder 'logs' \(the tag asked .*tags present: {listed}"):
        _locate(path, "logs")
    empty = _folder(tmp_path / "empty", {"notes.txt": "x"})
    with pytest.raises(CheckpointFormatError, match="no tag folder 'global_step1' .* holds no tag folder with rank"):
        _locate(empty, "global_step1")


def test_latest_naming_a_folder_that_is_not_there_lists_the_tags(tmp_path):
    path = _checkpoint(tmp_path / "ckpt", "global_step2", latest="global_step7")
    with pytest.raises(CheckpointFormatError, match=r"no tag folder 'global_step7' \(named by its 'latest' file\); "
                       r"tags present: \['global_step2'\]"):
        _locate(path)
    bare = _folder(tmp_path / "bare", {"latest": "global_step7"})
    with pytest.raises(CheckpointFormatError, match="holds no tag folder with rank files"):
        _locate(bare)


@pytest.mark.parametrize(
    "passed", ["latest", "zero_to_fp32.py", "global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt"]
)
def test_a_file_inside_a_checkpoint_names_the_checkpoint_folder(tmp_path, passed):
    path = _checkpoint(tmp_path / "ckpt", "global_step1", latest="global_step1")
    _folder(tmp_path / "ckpt", {"zero_to_fp32.py": "# DeepSpeed's script"})
    folder = re.escape(path)
    with pytest.raises(CheckpointFormatError, match=f"is a file inside a DeepSpeed checkpoint; pass the .* '{folder}'"):
        _locate(os.path.join(path, passed))


def test_the_latest_file_of_a_checkpoint_inside_another_names_its_own_folder(tmp_path):
    _folder(tmp_path / "runs", {"latest": "a"})
    inner = _checkpoint(tmp_path / "runs" / "a", "global_step1", latest="global_step1")
    with pytest.raises(CheckpointFormatError, match=f"pass the checkpoint folder '{re.escape(inner)}'"):
        _locate(os.path.join(inner, "latest"))


def test_a_rank_file_of_a_tag_folder_alone_names_the_tag_folder(tmp_path):
    tag_dir = _folder(tmp_path / "global_step1", {name: None for name in Z3})
    with pytest.raises(CheckpointFormatError, match=f"pass the checkpoint folder '{re.escape(tag_dir)}'"):
        _locate(os.path.join(tag_dir, Z3[0]))


def test_a_folder_of_checkpoints_and_a_folder_inside_one_say_which_to_pass(tmp_path):
    runs = tmp_path / "runs"
    for run in ("a", "b"):
        _checkpoint(runs / run, "global_step1", latest="global_step1")
    where = re.escape(str(runs))
    with pytest.raises(CheckpointFormatError, match=rf"holds 2 of them in sub-folders; pass one, e\.g\. '{where}/a'"):
        _locate(str(runs))
    os.mkdir(runs / "a" / "global_step1" / "extra")
    with pytest.raises(CheckpointFormatError, match=f"a sub-folder of the checkpoint '{where}/a/global_step1'"):
        _locate(str(runs / "a" / "global_step1" / "extra"))


def test_a_checkpoint_in_memory_is_found_and_named_by_its_url():
    fs, _ = resolve("memory://")
    fs.pipe({"/zckpt/latest": b"global_step4", **{f"/zckpt/global_step4/{name}": b"" for name in Z3}})
    try:
        found = _locate("memory://zckpt")
        assert (found.tag, found.layout) == ("global_step4", "deepspeed")
        with pytest.raises(CheckpointFormatError, match=r"'memory:///zckpt' has no tag folder 'global_step5'"):
            _locate("memory://zckpt", "global_step5")
    finally:
        fs.rm("/zckpt", recursive=True)


# -- the rank files in a tag folder ----------------------------------------------------------------------------------


def test_rank_files_by_data_parallel_rank():
    assert rank_file_names("t", Z3) == RankFileNames(
        optim={0: Z3[1], 1: Z3[3]}, model={0: Z3[0], 1: Z3[2]}, zero3_model=True
    )
    assert rank_file_names("t", [*Z12, "zero_to_fp32.py"]) == RankFileNames(
        optim={0: Z12[1], 1: Z12[2]}, model={0: Z12[0]}, zero3_model=False
    )
    bf16 = ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]
    assert rank_file_names("t", bf16).optim == {0: bf16[0]}


@pytest.mark.parametrize(
    "names,message",
    [
        ([*Z3, "expp_rank_0_mp_rank_00_optim_states.pt"], "mixture-of-experts or pipeline-parallel"),
        ([*Z3, "layer_01_expert_0_mp_rank_00_model_states.pt"], "mixture-of-experts or pipeline-parallel"),
        ([*Z3, "layer_01-model_00-model_states.pt"], "mixture-of-experts or pipeline-parallel"),
        ([*Z3, "zero_pp_rank_0_mp_rank_01_optim_states.pt"], r"model-parallel ranks \[1\]"),
        ([*Z3, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"], "optimizer files of two runs"),
        ([Z3[0], Z3[2]], "holds model states but no '\\*_optim_states.pt' files"),
        (["notes.txt"], "holds no '\\*_model_states.pt' and no '\\*_optim_states.pt' files"),
        ([Z3[1], Z3[3]], "optimizer files but no '\\*_model_states.pt' file"),
    ],
    ids=["moe_optim", "moe_model", "pipeline", "model_parallel", "two_runs", "no_optim", "nothing", "no_model"],
)
def test_rank_files_stagesafe_does_not_read_are_refused_saying_why(names, message):
    with pytest.raises(CheckpointFormatError, match=message):
        rank_file_names("ckpt/global_step1", names)
