"""Reading real DeepSpeed ZeRO checkpoints: zero_checkpoint.py, and the Python functions of consolidate.py.

The checkpoints are written by real DeepSpeed on CPU (2 ranks, gloo) once per session; the reference is
DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``.
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import shutil

import fsspec
import pytest
import torch
from _hostile import opened_files, outside, run_python, write_zero_checkpoint
from _launch import zero_checkpoints
from _tensors import assert_bitwise_equal

from stagesafe.consolidate import (
    consolidate,
    inspect_checkpoint,
    load_zero_checkpoint,
    load_zero_checkpoint_with_client_state,
)
from stagesafe.errors import CheckpointFormatError, InvalidArgumentError, UnsafeCheckpointError
from stagesafe.handoff.digest import DEFAULT
from stagesafe.handoff.read import load_state_dict
from stagesafe.publishing.verify import verify
from stagesafe.zero.checkpoint import open_zero_checkpoint
from stagesafe.zero.rank_file import RankFile

pytestmark = pytest.mark.timeout(300)  # the first test pays for building the checkpoints (up to ~40 s cold)

ALL = ("s1", "s2", "s3", "s1b", "s2b", "s3b", "lit")
FROZEN = {"frozen.weight", "frozen.bias"}


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    return zero_checkpoints(str(tmp_path_factory.getbasetemp() / "zero"))


def deepspeed_reference(path: str, tag: str | None = None, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """DeepSpeed's own consolidation (it prints progress; keep the test output clean)."""
    zero_to_fp32 = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(path, tag, exclude_frozen)


def copy_checkpoint(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def assert_bit_equal(ours: dict, ref: dict) -> None:
    """Every tensor of ``ref`` is in ``ours``, bit for bit (``ours`` may hold more: stage 1's frozen parameters)."""
    assert_bitwise_equal({name: ours[name] for name in ref}, ref)


# -- the values ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_checkpoints_equal_deepspeed_and_consolidate_without_torch(tmp_path_factory, tmp_path, stage):
    """fp16 training (DynamicLossScaler in the optimizer state, fp16 frozen parameters and buffers): the reader
    and the command give DeepSpeed's values bit for bit, and the command loads no torch for them."""
    built = zero_checkpoints(
        str(tmp_path_factory.getbasetemp() / "zero_fp16"),
        ("h1:stage=1,dtype=fp16", "h2:stage=2,dtype=fp16", "h3:stage=3,dtype=fp16"),
    )
    path = built[f"h{stage}"]["path"]
    ref = deepspeed_reference(path)
    ours = load_zero_checkpoint(path)
    assert set(ours) - set(ref) == (FROZEN if stage == 1 else set())  # stage 1: frozen ones kept (module doc)
    assert ours["frozen.weight"].dtype == torch.float16 and ours["scale"].dtype == torch.float32
    assert_bit_equal(ours, ref)
    out = str(tmp_path / "out")
    code = "import sys; from stagesafe.cli import main; rc = main(['consolidate', *sys.argv[1:], '-q']); print('torch' in sys.modules); sys.exit(rc)"
    result = run_python(code, path, out)
    assert result.returncode == 0 and result.stdout.split() == ["False"], result.stderr[-2000:]
    assert_bit_equal(load_state_dict(out), ref)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w3s2", "w3s3"])
def test_three_ranks_equal_deepspeed(tmp_path_factory, name):
    """World size 3: other paddings (ZeRO-2 aligns groups to 2 * 3 elements, ZeRO-3 splits params in thirds)."""
    built = zero_checkpoints(
        str(tmp_path_factory.getbasetemp() / "zero3ranks"),
        ("w3s2:stage=2,dtype=fp32", "w3s3:stage=3,dtype=fp32"),
        world_size=3,
    )
    path = built[name]["path"]
    with open_zero_checkpoint(path) as ckpt:
        assert ckpt.world_size == 3
    ours = load_zero_checkpoint(path)
    ref = deepspeed_reference(path)
    assert set(ours) == set(ref)
    assert_bit_equal(ours, ref)


@pytest.mark.parametrize("name", ALL)
def test_equals_deepspeed_bit_for_bit(ckpts, name):
    path = ckpts[name]["path"]
    ours = load_zero_checkpoint(path)
    ref = deepspeed_reference(path)
    assert_bit_equal(ours, ref)
    # Same order as DeepSpeed's; stage 1 additionally keeps the frozen layer, which DeepSpeed drops.
    assert [k for k in ours if k in ref] == list(ref)
    extra = set(ours) - set(ref)
    assert extra == (FROZEN if ckpts[name]["stage"] == 1 else set())
    assert ours["head.weight"] is ours["embed.weight"]  # tied, as in DeepSpeed's dict


def test_stage1_frozen_parameters_come_from_the_saved_module(ckpts):
    """DeepSpeed's stage-1 checkpoint lists no frozen_param_shapes; the saved module holds the frozen layer."""
    path = ckpts["s1"]["path"]
    ours = load_zero_checkpoint(path)
    module_file = os.path.join(path, "global_step2", "mp_rank_00_model_states.pt")
    module = torch.load(module_file, weights_only=False)["module"]
    for name in FROZEN:
        assert torch.equal(ours[name], module[name])
    # and frozen values equal those of stage 2/3, whose DeepSpeed reader returns them (same seed, never trained)
    s2 = load_zero_checkpoint(ckpts["s2"]["path"])
    for name in FROZEN:
        assert torch.equal(ours[name], s2[name])


@pytest.mark.parametrize("name", ["s2", "s3"])
def test_exclude_frozen_equals_deepspeed(ckpts, name):
    path = ckpts[name]["path"]
    ours = load_zero_checkpoint(path, exclude_frozen=True)
    ref = deepspeed_reference(path, exclude_frozen=True)
    assert set(ours) == set(ref)
    assert not FROZEN & set(ours)
    assert_bit_equal(ours, ref)


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_is_deepspeeds_cast(ckpts, dtype, torch_dtype):
    path = ckpts["s3"]["path"]
    ours = load_zero_checkpoint(path, dtype=dtype)
    ref = deepspeed_reference(path)
    for name, tensor in ref.items():
        expected = tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
        assert ours[name].dtype == expected.dtype
        assert torch.equal(ours[name], expected), name
    assert ours["counter"].dtype == torch.int64  # integer buffers keep their dtype


def test_bad_dtype_is_refused(ckpts):
    with pytest.raises(InvalidArgumentError, match="fp32, bf16, fp16"):
        load_zero_checkpoint(ckpts["s3"]["path"], dtype="int8")


# -- the description -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_describes_without_reading(ckpts, name):
    info = ckpts[name]
    ref = deepspeed_reference(info["path"])
    with open_zero_checkpoint(info["path"]) as ckpt:
        assert ckpt.stage == info["stage"]
        assert ckpt.world_size == 2
        assert ckpt.layout == ("lightning" if name == "lit" else "deepspeed")
        assert ckpt.tag == ("checkpoint" if name == "lit" else "global_step2")
        assert ckpt.aliases == {"head.weight": "embed.weight"}
        for tensor_name, spec in ckpt.tensors.items():
            if tensor_name in ref:
                assert spec.shape == tuple(ref[tensor_name].shape)
                assert spec.dtype == str(ref[tensor_name].dtype).removeprefix("torch.")
        kinds = {n: s.kind for n, s in ckpt.tensors.items()}
        assert kinds["scale"] == kinds["counter"] == "buffer"
        assert kinds["frozen.weight"] == "frozen" and kinds["embed.weight"] == "param"
        assert "scratch" not in kinds  # a non-persistent buffer is not saved
        assert ckpt.total_bytes == sum(s.nbytes for s in ckpt.tensors.values())


def test_read_returns_tensors_of_their_own(ckpts):
    """No view into the mapped rank files escapes: each tensor owns exactly its bytes."""
    with open_zero_checkpoint(ckpts["s3"]["path"]) as ckpt:
        tensors = dict(ckpt.iter_tensors())
    for tensor in tensors.values():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        tensor.add_(0)  # writable, and the files are closed


@pytest.mark.parametrize("name", ALL)
def test_pieces_are_read_one_at_a_time_and_join_into_read(ckpts, name):
    """What the CLI writes without torch: every tensor comes as the bytes of pieces read from the rank files as
    they are iterated (a 16-bit buffer widened to fp32), and they join into exactly the bytes read() returns."""
    with open_zero_checkpoint(ckpts[name]["path"]) as ckpt:
        for tensor_name, spec in ckpt.tensors.items():
            parts = ckpt.pieces(tensor_name)
            joined = b"".join(bytes(part) for part in parts)
            assert len(joined) == spec.nbytes, tensor_name
            assert joined == ckpt.read(tensor_name).reshape(-1).view(torch.uint8).numpy().tobytes(), tensor_name


def test_lightning_client_state(ckpts):
    values, client = load_zero_checkpoint_with_client_state(ckpts["lit"]["path"])
    assert set(values) >= {"embed.weight", "head.weight", "scale"}
    assert client["global_step"] == 2 and client["epoch"] == 0
    assert client["hyper_parameters"] == {"lr": 0.05, "hidden": 13}  # an AttributeDict, read as a dict
    assert "callbacks" in client and "loops" in client
    assert not {"module", "optimizer", "param_shapes", "ds_config", "buffer_names"} & set(client)


# -- finding the checkpoint ------------------------------------------------------------------------------------


def test_tag_folder_and_explicit_tag(ckpts):
    path = ckpts["s2"]["path"]
    ref = load_zero_checkpoint(path)
    assert_bit_equal(load_zero_checkpoint(os.path.join(path, "global_step2")), ref)
    assert_bit_equal(load_zero_checkpoint(path, tag="global_step2"), ref)


def test_unknown_tag_lists_the_tags(ckpts):
    with pytest.raises(CheckpointFormatError, match=r"no tag folder 'global_step9'.*\['global_step2'\]"):
        open_zero_checkpoint(ckpts["s2"]["path"], tag="global_step9")
    with pytest.raises(CheckpointFormatError, match="not a tag folder name"):
        open_zero_checkpoint(ckpts["s2"]["path"], tag="../s3")


def test_latest_naming_a_missing_tag(ckpts, tmp_path):
    path = copy_checkpoint(ckpts["s2"]["path"], tmp_path / "c")
    with open(os.path.join(path, "latest"), "w") as f:
        f.write("global_step7")
    with pytest.raises(CheckpointFormatError, match=r"no tag folder 'global_step7' \(named by its 'latest' file\)"):
        open_zero_checkpoint(path)


def test_without_latest_asks_for_a_tag(ckpts, tmp_path):
    path = copy_checkpoint(ckpts["s2"]["path"], tmp_path / "c")
    os.remove(os.path.join(path, "latest"))
    with pytest.raises(CheckpointFormatError, match=r"no 'latest' file.*--tag.*\['global_step2'\]"):
        open_zero_checkpoint(path)
    assert set(load_zero_checkpoint(path, tag="global_step2")) >= {"embed.weight"}


def test_parent_folder_suggests_its_checkpoints(ckpts):
    parent = os.path.dirname(ckpts["s3"]["path"])
    with pytest.raises(CheckpointFormatError, match=r"holds \d+ of them in sub-folders; pass one, e\.g\."):
        open_zero_checkpoint(parent)


def test_file_or_sub_folder_suggests_the_checkpoint(ckpts, tmp_path):
    path = ckpts["s3"]["path"]
    rank_file = os.path.join(path, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(
        CheckpointFormatError, match=f"file inside a DeepSpeed checkpoint; pass the checkpoint folder '{path}'"
    ):
        open_zero_checkpoint(rank_file)
    copy = copy_checkpoint(path, tmp_path / "c")
    os.mkdir(os.path.join(copy, "global_step2", "extra"))
    with pytest.raises(CheckpointFormatError, match="looks like a sub-folder of the checkpoint"):
        open_zero_checkpoint(os.path.join(copy, "global_step2", "extra"))


@pytest.mark.parametrize(
    "name,remove",
    [
        ("s3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("s3", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
        ("s2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("s3b", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ],
)
def test_missing_rank_file_is_named(ckpts, tmp_path, name, remove):
    path = copy_checkpoint(ckpts[name]["path"], tmp_path / "c")
    os.remove(os.path.join(path, "global_step2", remove))
    with pytest.raises(CheckpointFormatError, match=rf"missing rank files \['{remove}'\].*written by 2 ranks"):
        open_zero_checkpoint(path)


def test_no_optimizer_files(ckpts, tmp_path):
    path = copy_checkpoint(ckpts["s3"]["path"], tmp_path / "c")
    for f in os.listdir(os.path.join(path, "global_step2")):
        if f.endswith("_optim_states.pt"):
            os.remove(os.path.join(path, "global_step2", f))
    with pytest.raises(CheckpointFormatError, match=r"no '\*_optim_states.pt' files: it is not a ZeRO checkpoint"):
        open_zero_checkpoint(path)


def test_malicious_rank_file_is_refused_not_run(ckpts, tmp_path):
    path = copy_checkpoint(ckpts["s3"]["path"], tmp_path / "c")
    marker = tmp_path / "pwned"
    target = os.path.join(path, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": _Payload(f"touch {marker}")}, target)
    with pytest.raises(UnsafeCheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt.*system"):
        open_zero_checkpoint(path)
    assert not marker.exists()


class _Payload:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_remote_source_is_staged_and_cleaned(ckpts):
    fs = fsspec.filesystem("memory")
    fs.put(ckpts["s3"]["path"], "/remote-src/s3", recursive=True)
    try:
        ckpt = open_zero_checkpoint("memory://remote-src/s3")
        staging = ckpt.staging_dir
        with ckpt:
            assert os.path.isdir(staging)
            values = ckpt.load_state_dict()
        assert not os.path.exists(staging) and ckpt.staging_dir is None
        assert_bit_equal(values, deepspeed_reference(ckpts["s3"]["path"]))
    finally:
        fs.rm("/remote-src", recursive=True)


# -- consolidate() and inspect_checkpoint() --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["s1", "s2", "s3", "lit"])
def test_consolidate_round_trip(ckpts, tmp_path, name):
    dst = str(tmp_path / "out")
    manifest = consolidate(ckpts[name]["path"], dst, max_shard_size=1024)
    assert len(manifest["shards"]) > 1
    assert manifest["aliases"] == {"head.weight": "embed.weight"}
    assert manifest["metadata"]["source"]["zero_stage"] == ckpts[name]["stage"]
    verify(dst)
    assert_bit_equal(load_state_dict(dst), deepspeed_reference(ckpts[name]["path"]))


def test_consolidate_workers_give_identical_shards(ckpts, tmp_path):
    one = consolidate(ckpts["s3"]["path"], str(tmp_path / "one"), max_shard_size=600)
    four = consolidate(ckpts["s3"]["path"], str(tmp_path / "four"), max_shard_size=600, workers=4)

    def untagged(names):  # each commit's names carry a tag of its own
        return [name.split("-", 2)[2] for name in names]

    assert untagged(one["shards"]) == untagged(four["shards"])
    assert one["digest"] == four["digest"] == DEFAULT  # the CLI's output records the digest new handoffs record
    assert [r[DEFAULT] for r in one["shards"].values()] == [r[DEFAULT] for r in four["shards"].values()]
    assert {k: untagged([v])[0] for k, v in one["weight_map"].items()} == {
        k: untagged([v])[0] for k, v in four["weight_map"].items()
    }


def test_consolidate_to_memory_url(ckpts):
    try:
        consolidate(ckpts["s2b"]["path"], "memory://consolidated/s2b", dtype="bf16")
        values = load_state_dict("memory://consolidated/s2b")
        ref = deepspeed_reference(ckpts["s2b"]["path"])
        for name, tensor in ref.items():
            expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            assert torch.equal(values[name], expected), name
    finally:
        fsspec.filesystem("memory").rm("/consolidated", recursive=True)


def test_failed_consolidate_leaves_nothing(ckpts, tmp_path, monkeypatch):
    from stagesafe.handoff import shards

    calls = []

    def failing_write_shard(fs, root, file_name, tensors, **options):
        calls.append(file_name)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(fs, root, file_name, tensors, **options)

    real = shards.write_shard
    monkeypatch.setattr(shards, "write_shard", failing_write_shard)
    dst = tmp_path / "out"
    with pytest.raises(OSError, match="simulated"):
        consolidate(ckpts["s3"]["path"], str(dst), max_shard_size=1024)
    assert len(calls) == 2
    assert not dst.exists()


def test_consolidate_progress_bar(ckpts, tmp_path, capsys):
    pytest.importorskip("tqdm")
    consolidate(ckpts["s3"]["path"], str(tmp_path / "bar"), progress=True)
    assert "consolidating global_step2" in capsys.readouterr().err
    consolidate(ckpts["s3"]["path"], str(tmp_path / "quiet"))  # default: only on a terminal
    assert capsys.readouterr().err == ""


def test_inspect_checkpoint_both_kinds(ckpts, tmp_path):
    zero = inspect_checkpoint(ckpts["s3"]["path"])
    assert zero["kind"] == "deepspeed" and zero["zero_stage"] == 3 and zero["world_size"] == 2
    rows = {r["name"]: r for r in zero["tensors"]}
    assert rows["head.weight"]["alias_of"] == "embed.weight"
    assert rows["embed.weight"]["shape"] == [37, 13] and rows["embed.weight"]["kind"] == "param"

    dst = str(tmp_path / "out")
    consolidate(ckpts["s3"]["path"], dst)
    handoff = inspect_checkpoint(dst)
    assert handoff["kind"] == "handoff"
    assert handoff["totals"]["tensors"] == zero["totals"]["tensors"]
    assert handoff["totals"]["elements"] == zero["totals"]["elements"]
    assert {r["name"] for r in handoff["tensors"]} == set(rows)


# -- hostile checkpoints: files crafted by someone who knows DeepSpeed's layout -------------------------------------


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(5, 3, generator=g), "a.bias": torch.randn(5, generator=g)}


def _crafted(tmp_path, edit=None, **options) -> str:
    return write_zero_checkpoint(str(tmp_path / "ckpt"), _params(), edit=edit, **options)


def test_a_crafted_checkpoint_in_deepspeeds_layout_reads_as_written(tmp_path):
    """The helper that crafts the hostile files writes checkpoints the reader accepts, for both layouts."""
    for stage in (2, 3):
        buffers = {"n": torch.arange(3)}
        path = write_zero_checkpoint(str(tmp_path / f"s{stage}"), _params(), stage=stage, buffers=buffers)
        values = load_zero_checkpoint(path)
        assert_bit_equal(values, {**_params(), "n": torch.arange(3)})


@pytest.mark.slow
def test_a_stride_0_view_is_refused_instead_of_read_past_its_storage(tmp_path):
    """A flat partition that is a stride-0 view of 4 bytes with 2**24 elements: the reader once gave back the
    pages of numel x itemsize bytes from its 4-byte storage, zeroing memory it did not own (SIGSEGV)."""

    def edit(kind, rank, states):
        if kind == "optim":
            states["optimizer_state_dict"]["fp32_flat_groups"] = [torch.ones(1).expand(2**24)]
        else:
            states["param_shapes"] = [{"w": torch.Size([2**25])}]

    src = _crafted(tmp_path, edit)
    dst = tmp_path / "out"
    result = run_python("import sys; from stagesafe.cli import main; sys.exit(main(sys.argv[1:]))",
                        "consolidate", src, str(dst))
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "strides [0]" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not dst.exists()


@pytest.mark.slow
def test_a_rank_file_truncated_while_open_is_an_error_not_sigbus(tmp_path):
    """DeepSpeed saving the same tag again truncates the rank files in place. A mapped reader touching a page
    past the new end dies of SIGBUS; this reader reads with pread and says what happened."""
    src = _crafted(tmp_path)
    victim = os.path.join(src, "global_step1", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    code = (
        "import os, sys\n"
        "from stagesafe.zero.checkpoint import open_zero_checkpoint\n"
        "from stagesafe.errors import CheckpointFormatError\n"
        "with open_zero_checkpoint(sys.argv[1]) as ckpt:\n"
        "    os.truncate(sys.argv[2], 100)\n"
        "    for how in ('read', 'pieces'):\n"
        "        try:\n"
        "            for name in ckpt.tensors:\n"
        "                ckpt.read(name) if how == 'read' else list(ckpt.pieces(name))\n"
        "        except CheckpointFormatError as exc:\n"
        "            print(how, exc)\n"
    )
    result = run_python(code, src, victim)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["read", "pieces"], result.stdout
    assert all("shrank while being read" in line and "saved again" in line for line in lines), result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "count", [10**12, "2", [2, "x"], 0, True, -1, None, 2.0], ids=lambda c: f"partition_count={c!r}"
)
def test_a_partition_count_that_is_not_the_ranks_present_is_refused_before_allocating(tmp_path, count):
    def edit(kind, rank, states):
        if kind == "optim":
            states["optimizer_state_dict"]["partition_count"] = count

    src = _crafted(tmp_path, edit)
    code = (
        "import sys\n"
        "from stagesafe.zero.checkpoint import open_zero_checkpoint\n"
        "from stagesafe.errors import CheckpointFormatError\n"
        "try:\n"
        "    open_zero_checkpoint(sys.argv[1])\n"
        "except CheckpointFormatError as exc:\n"
        "    print('refused', exc)\n"
    )
    result = run_python(code, src, memory=6 * 2**30)  # the address space a list of 10**12 ranks would overrun
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert result.stdout.startswith("refused "), result.stdout
    if count == 10**12:
        assert "written by 1000000000000 ranks" not in result.stdout  # bounded before any list of them is built
    assert len(result.stdout) < 700


def test_a_huge_latest_file_is_refused_in_one_short_line(tmp_path):
    src = _crafted(tmp_path)
    with open(os.path.join(src, "latest"), "w") as f:
        f.write("global_step1" * (8 * 2**20 // 12))
    with pytest.raises(CheckpointFormatError, match=r"latest is \d+ bytes, more than the 4096") as info:
        open_zero_checkpoint(src)
    assert len(str(info.value)) < 400
    with open(os.path.join(src, "latest"), "w") as f:
        f.write("x" * 4000)  # under the limit, no such folder: named, cut short
    with pytest.raises(CheckpointFormatError, match="no tag folder 'xxxx") as info:
        open_zero_checkpoint(src)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize(
    ("edit_model", "message"),
    [
        (lambda m: m["param_shapes"][0].update({"__metadata__": m["param_shapes"][0].pop("a.bias")}), "reserves"),
        (lambda m: m["param_shapes"][0].update({"a\ud800": m["param_shapes"][0].pop("a.bias")}), "lone surrogate"),
        (lambda m: m["module"].update({"c": torch.zeros(2, dtype=torch.complex128)}), "complex128"),
    ],
    ids=["__metadata__", "lone_surrogate", "complex128_buffer"],
)
def test_a_tensor_safetensors_cannot_store_fails_consolidate_before_a_byte_is_written(tmp_path, edit_model, message):
    def edit(kind, rank, states):
        if kind == "model":
            edit_model(states)
            states["buffer_names"] = ["c"]

    src = _crafted(tmp_path, edit)
    assert load_zero_checkpoint(src)  # in memory, a state dict holds it
    dst = tmp_path / "out"
    with pytest.raises(CheckpointFormatError, match=message) as info:
        consolidate(src, str(dst))
    assert "Nothing was written" in str(info.value)
    assert not dst.exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda k, r, s: k == "model" and s["param_shapes"][0].update({"a.weight": [-1, -15]}), r"shape.*\[-1, -15\]"),
        (lambda k, r, s: k == "model" and s["param_shapes"][0].update({"a.weight": [2**40, 2**40]}), "elements"),
        (lambda k, r, s: k == "model" and s["param_shapes"][0].update({"a.weight": [0, 2**63]}), "far more elements"),
        (lambda k, r, s: k == "model" and s["param_shapes"][0].update({"a.weight": "15"}), "not a list of sizes"),
        (lambda k, r, s: k == "model" and s["param_shapes"][0].update({7: s["param_shapes"][0].pop("a.bias")}), "7"),
        (lambda k, r, s: k == "model" and s.update(param_shapes=[["a.weight"]]), "not a dict"),
        (lambda k, r, s: k == "model" and s.update(module=[1, 2]), "not a dict"),
        (lambda k, r, s: k == "model" and s.update(shared_params=[1]), "not a dict"),
        (lambda k, r, s: k == "optim" and s["optimizer_state_dict"].update(fp32_flat_groups=torch.ones(3)), "list"),
        (lambda k, r, s: k == "optim" and s["optimizer_state_dict"].update(fp32_flat_groups=[3]), "not a tensor"),
        (lambda k, r, s: k == "optim" and s["optimizer_state_dict"].update(zero_stage="3"), "stage '3'"),
        (lambda k, r, s: k == "optim" and s.update(optimizer_state_dict=[]), "optimizer_state_dict"),
        (
            lambda k, r, s: k == "optim"
            and s["optimizer_state_dict"].update(fp32_flat_groups=[torch.ones(4, 4).t().reshape(16)[:8].t()]),
            "elements",
        ),
        (
            lambda k, r, s: k == "optim"
            and s["optimizer_state_dict"].update(fp32_flat_groups=[torch.ones(20, 2)[:, 0]]),
            "strides",
        ),
    ],
    ids=[
        "negative_shape",
        "shape_of_2_80_elements",
        "a_size_over_int64_beside_a_0",
        "shape_a_string",
        "name_an_int",
        "param_shapes_of_lists",
        "module_a_list",
        "shared_params_a_list",
        "flat_groups_a_tensor",
        "flat_group_an_int",
        "stage_a_string",
        "optimizer_state_a_list",
        "partition_too_short",
        "partition_strided",
    ],
)
def test_a_structure_deepspeed_never_writes_is_a_format_error(tmp_path, edit, message):
    src = _crafted(tmp_path, edit)
    with pytest.raises(CheckpointFormatError, match=message):
        with open_zero_checkpoint(src) as ckpt:
            ckpt.load_state_dict()


def test_a_rank_file_that_links_outside_its_folder_is_refused_unopened(tmp_path):
    src = _crafted(tmp_path)
    other = write_zero_checkpoint(str(tmp_path / "other"), _params())
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.remove(os.path.join(src, "global_step1", name))
    os.symlink(os.path.join(other, "global_step1", name), os.path.join(src, "global_step1", name))
    with opened_files() as opened, pytest.raises(CheckpointFormatError, match=f"missing rank files \\['{name}'\\]"):
        open_zero_checkpoint(src)  # a link is not a rank file; were it swapped in after the listing, see below
    assert not outside(opened, src)
    with pytest.raises(CheckpointFormatError, match="outside the folder"):
        RankFile(os.path.join(src, "global_step1"), name, display=name)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["rank_file", "latest"])
def test_a_fifo_in_a_checkpoint_never_blocks_the_reader(tmp_path, what):
    src = _crafted(tmp_path)
    name = "latest" if what == "latest" else "global_step1/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim = os.path.join(src, name)
    os.remove(victim)
    os.mkfifo(victim)
    result = run_python(
        "import sys; from stagesafe.cli import main; sys.exit(main(sys.argv[1:]))",
        "consolidate", src, str(tmp_path / "out"), timeout=120,
    )
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    expected = "missing rank files" if what == "rank_file" else "no 'latest' file"  # a FIFO is not a file
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_client_state_tensors_are_read_once_per_storage_and_never_beyond_the_file(tmp_path):
    big = torch.arange(1000.0)

    def edit(kind, rank, states):
        if kind == "model":
            states["callbacks"] = {"views": [big[i : i + 10] for i in range(0, 1000, 10)], "whole": big}

    _, client = load_zero_checkpoint_with_client_state(_crafted(tmp_path, edit))
    views = client["callbacks"]["views"]
    assert all(torch.equal(v, big[i * 10 : i * 10 + 10]) for i, v in enumerate(views))
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one storage, read once, as torch.load shares it
    assert torch.equal(client["callbacks"]["whole"], big)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_buffers_are_widened_as_deepspeed_widens_them(tmp_path, dtype):
    """DeepSpeed's reader gives a floating buffer as ``buffer.float()``; the reader, consolidate and its pieces
    give the same bits (zeros, a subnormal, infinities, a NaN whose payload shows how it was converted)."""
    bits = torch.tensor([0x0000, 0x8000, 0x0001, 0x3C00, 0x7C00, 0xFC00, 0x7E01, 0x7D01], dtype=torch.int32)
    buffer = bits.to(torch.int16).view(dtype)
    src = write_zero_checkpoint(str(tmp_path / "ckpt"), _params(), stage=2, buffers={"b": buffer})
    expected = buffer.float().view(torch.int32)
    assert torch.equal(load_zero_checkpoint(src)["b"].view(torch.int32), expected)
    consolidate(src, str(tmp_path / "out"))
    written = load_state_dict(str(tmp_path / "out"))["b"]
    assert written.dtype == torch.float32 and torch.equal(written.view(torch.int32), expected)


def _crafted_pickle(path: str, pickle_bytes: bytes) -> None:
    """Replace the pickle of the torch.save archive ``path`` with ``pickle_bytes`` (its CRC updated): what an
    attacker who knows the format writes; the storages stay."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        records = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for info, data in records:
            archive.writestr(info, pickle_bytes if info.filename.endswith("/data.pkl") else data)


def _text(value: str) -> bytes:
    """A pickled str (BINUNICODE)."""
    data = value.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


# Pickles whose payload creates the file ``marker``, if run: each is run by Python's pickle in the test first.
PAYLOADS = {
    "global_reduce": lambda marker: b"cposix\nsystem\n(" + _text(f"touch {marker}") + b"tR.",
    "open": lambda marker: b"\x80\x02cbuiltins\nopen\n" + _text(marker) + _text("w") + b"\x86R.",
    "inst": lambda marker: b"\x80\x02(" + _text(f"touch {marker}") + b"ios\nsystem\n.",
    "stack_global": lambda marker: b"\x80\x04" + _text("os") + _text("system") + b"\x93" + _text(f"touch {marker}")
    + b"\x85R.",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PAYLOADS))
def test_a_rank_file_whose_pickle_would_run_code_is_refused_and_nothing_runs(tmp_path, name):
    """The reader never calls what a pickle names: the file the payload creates when Python's pickle loads it is
    never created, the refusal names the rank file, and consolidate exits 2 leaving nothing."""
    marker = tmp_path / "pwned"
    data = PAYLOADS[name](str(marker))
    ran = run_python("import pickle, sys; pickle.loads(bytes.fromhex(sys.argv[1]))", data.hex())
    assert marker.exists(), ran.stderr[-2000:]  # the payload is live
    marker.unlink()
    src = _crafted(tmp_path)
    _crafted_pickle(os.path.join(src, "global_step1", "zero_pp_rank_0_mp_rank_00_optim_states.pt"), data)
    with pytest.raises(UnsafeCheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt.*nothing from the file"):
        open_zero_checkpoint(src)
    result = run_python("import sys; from stagesafe.cli import main; sys.exit(main(sys.argv[1:]))",
                        "consolidate", src, str(tmp_path / "out"))
    assert result.returncode == 2 and "refused to load" in result.stderr, result.stderr[-2000:]
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["truncated", "garbage", "pickle_byte_flipped", "legacy_format"])
def test_a_damaged_rank_file_is_a_format_error_naming_it(tmp_path, how):
    src = _crafted(tmp_path)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path = os.path.join(src, "global_step1", name)
    data = open(path, "rb").read()
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "garbage":
        data = b"PK\x03\x04" + b"\x00" * 100
    elif how == "pickle_byte_flipped":
        at = data.index(b"optimizer_state_dict")
        data = data[:at] + b"O" + data[at + 1 :]
    else:
        buffer = io.BytesIO()
        torch.save({"w": torch.ones(4)}, buffer, _use_new_zipfile_serialization=False)
        data = buffer.getvalue()
    with open(path, "wb") as f:
        f.write(data)
    expected = {"pickle_byte_flipped": "fails its CRC check", "legacy_format": "not a zip-format torch file"}
    with pytest.raises(CheckpointFormatError, match=rf"{name}.*{expected.get(how, 'cannot be read')}"):
        open_zero_checkpoint(src)


# -- the opt-in to trust a checkpoint's pickles ------------------------------------------------------------------


class Shade(enum.Enum):
    """A user's Enum, kept in a checkpoint's hyperparameters."""

    DARK = "dark"


class _Touch:
    """Creates ``path`` when unpickled by Python's pickle (a user's object whose ``__reduce__`` calls os.system)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _with_client_state(tmp_path, client: dict) -> str:
    def edit(kind, rank, states):
        if kind == "model":
            states.update(client)

    return _crafted(tmp_path, edit=edit)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_trusting_a_checkpoint_gives_the_real_objects_by_torch_load_which_runs_its_code(tmp_path, monkeypatch, how):
    marker = tmp_path / "ran"
    src = _with_client_state(tmp_path, {"hyper_parameters": {"shade": Shade.DARK}, "payload": _Touch(str(marker))})
    with pytest.raises(UnsafeCheckpointError, match="STAGESAFE_TRUST_PICKLES=1 loads it with torch.load"):
        load_zero_checkpoint_with_client_state(src)
    assert not marker.exists()
    if how == "environment":
        monkeypatch.setenv("STAGESAFE_TRUST_PICKLES", "1")
    values, client = load_zero_checkpoint_with_client_state(src, trust_pickles=True if how == "argument" else None)
    assert client["hyper_parameters"]["shade"] is Shade.DARK
    assert marker.exists()  # what it opts into: the file's code ran
    assert_bit_equal(values, _params())


@pytest.mark.parametrize("value", ["false", "0", "no", 0, 1, "1", "true"])
def test_trust_pickles_that_is_not_a_bool_is_refused_and_runs_nothing(tmp_path, value):
    """bool("false") is True: a flag read as text must not turn code execution on."""
    marker = tmp_path / "ran"
    src = _with_client_state(tmp_path, {"payload": _Touch(str(marker))})
    with pytest.raises(InvalidArgumentError, match=f"trust_pickles={value!r} must be True, False or None"):
        load_zero_checkpoint_with_client_state(src, trust_pickles=value)
    assert not marker.exists()


def test_a_users_enum_in_the_client_state_is_a_stand_in_by_default(tmp_path, caplog):
    from stagesafe.zero.pickle_globals import OpaqueRecord

    src = _with_client_state(tmp_path, {"hyper_parameters": {"shade": Shade.DARK, "w": torch.ones(2)}})
    with caplog.at_level("WARNING", logger="stagesafe.zero.pickle_reader"):
        values, client = load_zero_checkpoint_with_client_state(src)
    shade = client["hyper_parameters"]["shade"]
    assert isinstance(shade, OpaqueRecord) and shade._stands_for.endswith(".Shade") and shade._args == ("dark",)
    assert torch.equal(client["hyper_parameters"]["w"], torch.ones(2))
    assert f"{__name__}.Shade" in caplog.text and "inert stand-ins" in caplog.text
    assert_bit_equal(values, _params())
