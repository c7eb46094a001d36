"""The ``stagesafe`` command line, in-process through ``main(argv)``, on real DeepSpeed checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile

import fsspec
import pytest
import torch
from _hostile import run_python
from _launch import sanitized_env, zero_checkpoints
from safetensors.torch import load_file

from stagesafe.cli import main
from stagesafe.handoff.read import load_state_dict

pytestmark = pytest.mark.timeout(300)  # the first test pays for building the checkpoints (up to ~40 s cold)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    return zero_checkpoints(str(tmp_path_factory.getbasetemp() / "zero"))


@pytest.fixture
def memfs():
    fs = fsspec.filesystem("memory")
    yield fs
    for path in ("/cli",):
        if fs.exists(path):
            fs.rm(path, recursive=True)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def deepspeed_reference(path: str, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    zero_to_fp32 = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(path, None, exclude_frozen)


def shard_files(folder) -> list[str]:
    return sorted(str(p) for p in folder.iterdir() if p.name.endswith(".safetensors"))


def assert_one_error_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("stagesafe"), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)


# -- consolidate: results ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["s1", "s2", "s3", "s3b", "lit"])
def test_consolidate_matches_deepspeed_and_every_shard_loads(ckpts, tmp_path, capsys, name):
    dst = tmp_path / "out"
    code, out, err = run(capsys, "consolidate", ckpts[name]["path"], str(dst), "--max-shard-size", "1000")
    assert code == 0, err
    assert err == ""  # not a terminal: no progress bar
    assert out.startswith("wrote ") and f"ZeRO-{ckpts[name]['stage']}" in out
    ref = deepspeed_reference(ckpts[name]["path"])
    files = shard_files(dst)
    assert len(files) > 1
    from_shards: dict[str, torch.Tensor] = {}
    for f in files:
        from_shards.update(load_file(f))  # plain safetensors, no stagesafe needed
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(from_shards)
    assert set(from_shards) | {"head.weight"} >= set(ref)  # the tied name is an alias, stored once
    for tensor_name, expected in ref.items():
        stored = from_shards[tensor_name if tensor_name != "head.weight" else "embed.weight"]
        assert stored.dtype == expected.dtype and torch.equal(stored, expected), tensor_name
    loaded = load_state_dict(str(dst))
    assert torch.equal(loaded["head.weight"], ref["head.weight"])


@pytest.mark.parametrize(
    "dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)]
)
def test_consolidate_dtype_is_deepspeeds_cast(ckpts, tmp_path, capsys, dtype, torch_dtype):
    dst = tmp_path / "out"
    code, _, err = run(capsys, "consolidate", ckpts["s2b"]["path"], str(dst), "--dtype", dtype)
    assert code == 0, err
    loaded = load_state_dict(str(dst))
    for name, tensor in deepspeed_reference(ckpts["s2b"]["path"]).items():
        expected = tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
        assert loaded[name].dtype == expected.dtype and torch.equal(loaded[name], expected), name


def test_consolidate_exclude_frozen(ckpts, tmp_path, capsys):
    dst = tmp_path / "out"
    assert run(capsys, "consolidate", ckpts["s3"]["path"], str(dst), "--exclude-frozen")[0] == 0
    loaded = load_state_dict(str(dst))
    ref = deepspeed_reference(ckpts["s3"]["path"], exclude_frozen=True)
    assert set(loaded) == set(ref) and "frozen.weight" not in loaded


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_consolidate_to_urls(ckpts, tmp_path, capsys, memfs, scheme):
    dst = "memory://cli/out" if scheme == "memory" else f"file://{tmp_path}/out"
    code, _, err = run(capsys, "consolidate", ckpts["s3"]["path"], dst, "--max-shard-size", "2KB", "--workers", "2")
    assert code == 0, err
    assert run(capsys, "verify", dst)[0] == 0
    loaded = load_state_dict(dst)
    for name, tensor in deepspeed_reference(ckpts["s3"]["path"]).items():
        assert torch.equal(loaded[name], tensor), name


def test_consolidate_from_a_url(ckpts, tmp_path, capsys, memfs):
    memfs.put(ckpts["s2"]["path"], "/cli/src", recursive=True)
    dst = tmp_path / "out"
    code, _, err = run(
        capsys, "consolidate", "memory://cli/src", str(dst), "--storage-option", "skip_instance_cache=true"
    )
    assert code == 0, err
    loaded = load_state_dict(str(dst))
    for name, tensor in deepspeed_reference(ckpts["s2"]["path"]).items():
        assert torch.equal(loaded[name], tensor), name


def test_consolidate_tag_and_overwrite(ckpts, tmp_path, capsys):
    dst = tmp_path / "out"
    assert run(capsys, "consolidate", ckpts["s3"]["path"], str(dst), "--tag", "global_step2", "-q") == (0, "", "")
    code, _, err = run(capsys, "consolidate", ckpts["s2"]["path"], str(dst))
    assert code == 2
    assert_one_error_line(err, str(dst), "already holds a handoff", "--overwrite")
    code, _, err = run(capsys, "consolidate", ckpts["s2"]["path"], str(dst), "--overwrite", "-q")
    assert code == 0, err
    manifest = json.loads((dst / "stagesafe.json").read_text())
    assert manifest["metadata"]["source"]["zero_stage"] == 2
    assert len(shard_files(dst)) == len(manifest["shards"])  # the replaced handoff's shards are gone


# -- consolidate: bad input ----------------------------------------------------------------------------------------


def _break_copy(ckpts, tmp_path, name="s3"):
    return shutil.copytree(ckpts[name]["path"], tmp_path / "broken")


@pytest.mark.parametrize(
    "case",
    [
        "empty",
        "parent",
        "rank-file",
        "missing-rank",
        "truncated-rank",
        "unknown-tag",
        "unknown-protocol",
        "missing-backend",
        "bad-size",
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(ckpts, tmp_path, capsys, monkeypatch, case):
    src, extra, expect = ckpts["s3"]["path"], [], []
    if case == "empty":
        (tmp_path / "empty").mkdir()
        src, expect = str(tmp_path / "empty"), ["is not a DeepSpeed checkpoint", "'latest'", "_optim_states.pt"]
    elif case == "parent":
        src, expect = os.path.dirname(ckpts["s3"]["path"]), ["sub-folders; pass one", ckpts["s3"]["path"][:-3]]
    elif case == "rank-file":
        src = os.path.join(ckpts["s3"]["path"], "global_step2", "zero_pp_rank_0_mp_rank_00_model_states.pt")
        expect = ["file inside a DeepSpeed checkpoint", f"pass the checkpoint folder '{ckpts['s3']['path']}'"]
    elif case == "missing-rank":
        broken = _break_copy(ckpts, tmp_path)
        os.remove(broken / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        src, expect = str(broken), ["missing rank files", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    elif case == "truncated-rank":
        broken = _break_copy(ckpts, tmp_path)
        victim = broken / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        victim.write_bytes(victim.read_bytes()[:1000])
        src, expect = str(broken), ["zero_pp_rank_1_mp_rank_00_optim_states.pt cannot be read", "truncated"]
    elif case == "unknown-tag":
        extra, expect = ["--tag", "global_step9"], ["no tag folder 'global_step9'", "global_step2"]
    elif case == "bad-size":
        extra, expect = ["--max-shard-size", "5XB"], ["is not a size", "5GB"]
    dst = str(tmp_path / "out")
    if case == "unknown-protocol":
        dst, expect = "nosuchfs://bucket/out", ["no filesystem is known for protocol 'nosuchfs'"]
    elif case == "missing-backend":
        monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed: importing it fails
        monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
        dst, expect = "s3://bucket/out", ["s3fs", "stagesafe[s3]"]
    code, out, err = run(capsys, "consolidate", src, dst, *extra)
    assert code == 2, err
    assert out == ""
    assert_one_error_line(err, *expect)
    assert not os.path.exists(tmp_path / "out")


def test_destination_that_is_a_file(ckpts, tmp_path, capsys):
    (tmp_path / "out").write_text("x")
    code, _, err = run(capsys, "consolidate", ckpts["s3"]["path"], str(tmp_path / "out"), "--overwrite")
    assert code == 2
    assert_one_error_line(err, "is a file")


def test_usage_errors_exit_2(capsys):
    for argv in (
        ["consolidate"],
        ["consolidate", "a", "b", "--dtype", "int8"],
        ["consolidate", "a", "b", "--workers", "0"],
        [],
    ):
        code, _, err = run(capsys, *argv)
        assert code == 2, argv
        assert_one_error_line(err)
    code, _, err = run(capsys, "consolidate", "a", "b", "--storage-option", "novalue")
    assert code == 2 and "KEY=VALUE" in err


def test_unexpected_error_is_one_line_exit_1_or_a_traceback_when_asked(ckpts, tmp_path, capsys, monkeypatch):
    import importlib

    consolidate_module = importlib.import_module("stagesafe.consolidate")  # the package exports a function of that name

    def broken(*args, **kwargs):
        raise RuntimeError("backend said no")

    monkeypatch.setattr(consolidate_module, "consolidate", broken)
    code, _, err = run(capsys, "consolidate", ckpts["s3"]["path"], str(tmp_path / "out"))
    assert code == 1
    assert_one_error_line(err, "RuntimeError: backend said no", "--traceback")
    with pytest.raises(RuntimeError, match="backend said no"):
        main(["--traceback", "consolidate", ckpts["s3"]["path"], str(tmp_path / "out")])


def test_malicious_pickle_is_refused(ckpts, tmp_path, capsys):
    broken = _break_copy(ckpts, tmp_path)
    marker = tmp_path / "pwned"
    torch.save(
        {"module": _Payload(f"touch {marker}")}, broken / "global_step2" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    )
    code, _, err = run(capsys, "consolidate", str(broken), str(tmp_path / "out"))
    assert code == 2
    assert_one_error_line(
        err,
        "refused to load",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "system",
        "nothing from the file was executed",
    )
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


class _Payload:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


# -- inspect ---------------------------------------------------------------------------------------------------------


def test_inspect_handoff_table_and_json(ckpts, tmp_path, capsys):
    dst = tmp_path / "out"
    assert run(capsys, "consolidate", ckpts["s3"]["path"], str(dst), "--max-shard-size", "1000", "-q")[0] == 0
    code, out, _ = run(capsys, "inspect", str(dst))
    assert code == 0
    assert "embed.weight" in out and "float32" in out and "[37, 13]" in out and "-00001-of-" in out
    assert "= embed.weight (tied)" in out and "xxh3-128-tree" in out and "tensors (+1 tied)" in out
    code, out, _ = run(capsys, "inspect", str(dst), "--json")
    info = json.loads(out)
    assert info["kind"] == "handoff"
    assert info["totals"]["tensors"] == 9 and info["totals"]["aliases"] == 1
    assert info["totals"]["shards"] == len(info["manifest"]["shards"]) > 1
    rows = {r["name"]: r for r in info["tensors"]}
    assert rows["embed.weight"]["shard"].startswith("model-") and rows["head.weight"]["alias_of"] == "embed.weight"


def test_inspect_deepspeed_checkpoint(ckpts, capsys):
    code, out, _ = run(capsys, "inspect", ckpts["lit"]["path"])
    assert code == 0 and "DeepSpeed ZeRO-3 checkpoint" in out and "tag checkpoint" in out and "frozen" in out
    code, out, _ = run(capsys, "inspect", ckpts["s1"]["path"], "--json")
    info = json.loads(out)
    assert info["kind"] == "deepspeed" and info["zero_stage"] == 1 and info["world_size"] == 2


def test_inspect_nothing_there(tmp_path, capsys):
    code, _, err = run(capsys, "inspect", str(tmp_path))
    assert code == 2
    assert_one_error_line(err, "not a DeepSpeed checkpoint")


# -- verify ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def handoff(ckpts, tmp_path, capsys):
    dst = tmp_path / "out"
    assert run(capsys, "consolidate", ckpts["s3"]["path"], str(dst), "--max-shard-size", "1000", "-q")[0] == 0
    return dst


def test_verify_ok_names_the_digest_consolidate_recorded(handoff, capsys):
    with open(handoff / "stagesafe.json") as f:
        assert json.load(f)["digest"] == "xxh3-128-tree"  # the CLI's output records what every new handoff does
    code, out, err = run(capsys, "verify", str(handoff))
    assert code == 0 and out.startswith("ok: ") and out.rstrip().endswith("(digest xxh3-128-tree)") and err == ""
    assert run(capsys, "verify", str(handoff), "-q") == (0, "", "")


def test_the_console_entry_flushes_its_output_and_keeps_the_exit_code(handoff, tmp_path):
    """``stagesafe`` (``cli.run``) skips the interpreter's teardown: what it printed into a pipe still arrives,
    and the exit code is main()'s."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    entry = [sys.executable, "-c", "import stagesafe.cli as c; c.run()"]
    ok = subprocess.run([*entry, "verify", str(handoff)], capture_output=True, text=True, env=env, timeout=120)
    assert (ok.returncode, ok.stderr) == (0, "") and ok.stdout.startswith("ok: "), ok
    missing = subprocess.run(
        [*entry, "verify", str(tmp_path / "nothing")], capture_output=True, text=True, env=env, timeout=120
    )
    assert missing.returncode == 2 and missing.stdout == "", missing
    assert_one_error_line(missing.stderr, "nothing")


@pytest.mark.parametrize("damage", ["flip-byte", "truncate", "delete"])
def test_verify_names_the_bad_shard(handoff, capsys, damage):
    victim = shard_files(handoff)[1]
    with open(victim, "rb") as f:
        data = bytearray(f.read())
    if damage == "delete":
        os.remove(victim)
    else:
        if damage == "flip-byte":
            data[-3] ^= 0x01
        else:
            data = data[:-8]
        with open(victim, "wb") as f:
            f.write(bytes(data))
    code, out, err = run(capsys, "verify", str(handoff))
    assert code == 1
    assert out == ""
    assert_one_error_line(err, os.path.basename(victim))


def test_an_index_that_leaves_out_a_shard_fails_verify_and_fix_index_rewrites_it(handoff, capsys):
    """Loaders that follow the index (transformers) would get a partial model: a committed handoff whose index
    differs from its manifest is an error, even when what the index names exists and matches."""
    index_path = handoff / "model.safetensors.index.json"
    committed = json.loads(index_path.read_text())
    second = shard_files(handoff)[1]
    partial = {n: f for n, f in committed["weight_map"].items() if f != os.path.basename(second)}
    index_path.write_text(json.dumps({"metadata": committed["metadata"], "weight_map": partial}))
    code, out, err = run(capsys, "verify", str(handoff))
    assert code == 1 and out == ""
    assert_one_error_line(err, "differs from the committed manifest", "tensor(s) missing", "--fix-index")
    code, out, err = run(capsys, "verify", str(handoff), "--fix-index")
    assert code == 0 and out.startswith("ok: ")
    assert json.loads(index_path.read_text()) == committed
    assert run(capsys, "verify", str(handoff))[0] == 0


def test_a_shard_that_is_a_symlink_loop_is_one_line_exit_1(handoff, capsys):
    victim = shard_files(handoff)[0]
    os.remove(victim)
    os.symlink(os.path.basename(victim), victim)  # a link to itself
    code, out, err = run(capsys, "verify", str(handoff))
    assert code == 1 and out == ""
    assert_one_error_line(err, os.path.basename(victim), "leads to itself")


def test_inspect_shows_control_characters_in_names_escaped(tmp_path, capsys):
    from stagesafe.publishing.save import save_state_dict

    name = "layer\x1b[2J\x07\rhidden"
    save_state_dict({name: torch.zeros(2)}, str(tmp_path / "h"))
    code, out, err = run(capsys, "inspect", str(tmp_path / "h"))
    assert code == 0 and err == ""
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out  # nothing a terminal would act on
    assert "layer\\x1b[2J\\x07\\rhidden" in out


def test_verify_without_handoff_is_exit_2(ckpts, tmp_path, capsys):
    code, _, err = run(capsys, "verify", str(tmp_path))
    assert code == 2
    assert_one_error_line(err, "no handoff", "stagesafe.json")
    code, _, err = run(capsys, "verify", ckpts["s3"]["path"])
    assert code == 2
    assert_one_error_line(err, "no handoff", "is a DeepSpeed checkpoint", "stagesafe consolidate")


# -- what the commands import -------------------------------------------------------------------------------------------


def test_consolidate_inspect_and_verify_never_import_torch(ckpts, tmp_path):
    """The rank files are read by stagesafe's own pickle reader and written as bytes, so the commands load
    neither torch nor DeepSpeed nor Lightning, whatever the stage, dtype and layout; a cast (--dtype) does."""
    code = (
        "import sys\n"
        "from stagesafe.cli import main\n"
        "out = sys.argv[1]\n"
        "for i, src in enumerate(sys.argv[2:]):\n"
        "    assert main(['consolidate', src, f'{out}/{i}', '--max-shard-size', '1000', '-q']) == 0\n"
        "    assert main(['inspect', src, '--json']) == 0\n"
        "    assert main(['verify', f'{out}/{i}']) == 0 and main(['inspect', f'{out}/{i}']) == 0\n"
        "print('IMPORTED', sorted(m for m in ('torch', 'deepspeed', 'lightning') if m in sys.modules))\n"
        "assert main(['consolidate', src, f'{out}/cast', '--dtype', 'bf16', '-q']) == 0\n"
        "print('AFTER --dtype', 'torch' in sys.modules)\n"
    )
    sources = [ckpts[name]["path"] for name in ("s1", "s2b", "s3", "s3b", "lit")]
    result = run_python(code, str(tmp_path), *sources, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "IMPORTED []" in result.stdout and "AFTER --dtype True" in result.stdout, result.stdout


def test_importtime_of_consolidate_shows_no_torch(ckpts, tmp_path):
    """``python -X importtime -m stagesafe.cli consolidate ...``: the modules the command imports."""
    import subprocess

    command = [sys.executable, "-X", "importtime", "-m", "stagesafe.cli", "consolidate", ckpts["s3"]["path"]]
    result = subprocess.run(
        [*command, str(tmp_path / "out"), "-q"], env=sanitized_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    assert "stagesafe.zero.pickle_reader" in imported and "fsspec" in imported
    heavy = [m for m in imported if m.split(".")[0] in ("torch", "deepspeed", "lightning", "numpy")]
    assert not heavy, heavy[:10]


# -- help --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["consolidate", "inspect", "verify"])
def test_help_has_examples(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    assert "examples:" in out and f"stagesafe {command} " in out.split("examples:")[1]


# -- Lightning ---------------------------------------------------------------------------------------------------------


def test_lightning_layout_made_by_deepspeed(ckpts, tmp_path, capsys):
    """x.ckpt/ with 'latest' -> 'checkpoint' and Lightning's client state, as trainer.save_checkpoint writes it."""
    path = ckpts["lit"]["path"]
    with open(os.path.join(path, "latest")) as f:
        assert path.endswith(".ckpt") and f.read().strip() == "checkpoint"
    code, out, err = run(capsys, "consolidate", path, str(tmp_path / "out"))
    assert code == 0, err
    assert "tag checkpoint" in out


# -- exit codes of failures that are not the input's ---------------------------------------------------------------


@pytest.fixture
def world_readable(ckpts):
    """A folder outside pytest's private tmp root, with a copy of the s3 checkpoint: ``nobody`` can read both."""
    base = tempfile.mkdtemp(prefix="stagesafe-cli-")
    os.chmod(base, 0o755)
    shutil.copytree(ckpts["s3"]["path"], os.path.join(base, "src"))
    for folder, dirs, names in os.walk(base):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o755)
        for name in names:
            os.chmod(os.path.join(folder, name), 0o644)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("fault", ["read_only_folder", "file_size_limit"])
def test_an_output_that_cannot_be_written_is_exit_1_and_left_as_it_was(world_readable, fault):
    """docs/cli.md: 1 for an error of the system. A read-only folder (mode 0555; as ``nobody`` when the tests
    run as root, whom permission bits do not stop) and RLIMIT_FSIZE (EFBIG) are the system's, not the input's."""
    src, dst = os.path.join(world_readable, "src"), os.path.join(world_readable, "out")
    os.mkdir(dst, 0o555)
    os.chmod(dst, 0o555)
    as_nobody = fault == "read_only_folder" and os.geteuid() == 0
    result = run_python(
        "import os, pwd, sys\n"
        "from stagesafe.cli import main\n"
        "if sys.argv[1] == 'nobody':  # load what the command imports first: nobody cannot read root's Python\n"
        "    import gettext, locale, stagesafe.consolidate\n"
        "    os.setgid(pwd.getpwnam('nobody').pw_gid)\n"
        "    os.setuid(pwd.getpwnam('nobody').pw_uid)\n"
        "sys.exit(main(sys.argv[2:]))\n",
        "nobody" if as_nobody else "-",
        "consolidate", src, dst if fault == "read_only_folder" else os.path.join(world_readable, "fresh"),
        "--max-shard-size", "2KB", "-q",
        file_size=1024 if fault == "file_size_limit" else None,
    )
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert_one_error_line(result.stderr, "could not write shard")
    assert "builtins." not in result.stderr
    assert os.listdir(dst) == [] and not os.path.exists(os.path.join(world_readable, "fresh"))


def test_a_commit_that_fails_in_an_empty_destination_leaves_no_shard_behind(ckpts, tmp_path, capsys):
    dst = tmp_path / "out"
    (dst / "stagesafe.json").mkdir(parents=True)  # the manifest cannot be renamed into place: no commit
    code, _, err = run(capsys, "consolidate", ckpts["s3"]["path"], str(dst), "--max-shard-size", "2KB", "--overwrite")
    assert code == 1, err
    assert_one_error_line(err, "stagesafe.json")
    assert os.listdir(dst) == ["stagesafe.json"]  # the shards written before the commit are gone


_NO_AWS = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE":
           "/nonexistent", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}


@pytest.mark.parametrize(
    "options,error,hint",
    [
        (["-o", 'client_kwargs={"endpoint_url": "http://127.0.0.1:9"}'], "NoCredentialsError", "set AWS_ACCESS_KEY_ID"),
        (["-o", "profile=no-such-profile"], "ProfileNotFound", "that profile is not in ~/.aws/config"),
    ],
)
def test_an_object_store_credential_error_says_what_to_do(options, error, hint):
    import subprocess

    env = {k: v for k, v in sanitized_env().items() if not k.startswith("AWS_")}
    env.update({k: v for k, v in _NO_AWS.items() if v})
    result = subprocess.run([sys.executable, "-m", "stagesafe.cli", "verify", "s3://some-bucket/run", *options],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert_one_error_line(result.stderr, error, hint)


def test_consolidate_names_a_missing_source_before_asking_the_destinations_store(tmp_path, capsys, monkeypatch):
    for key, value in _NO_AWS.items():
        monkeypatch.setenv(key, value)
    code, _, err = run(capsys, "consolidate", str(tmp_path / "no-such-checkpoint"), "s3://some-bucket/weights")
    assert code == 2
    assert_one_error_line(err, "no-such-checkpoint", "does not exist")
    assert "credential" not in err.lower()


def test_progress_counts_in_the_units_the_summary_prints(capsys):
    from stagesafe.progress import bytes_bar

    assert bytes_bar(None, 10, "x") is None  # pytest's stderr is no terminal: a non-interactive run is quiet
    bar = bytes_bar(True, 470_500_000, "consolidating")
    bar.update(470_500_000)
    shown = str(bar)
    bar.close()
    assert "470M" in shown and "449M" not in shown  # "470.5 MB" in the summary line: decimal, not MiB


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_destination_under_a_regular_file_is_one_line_naming_the_real_cause(ckpts, tmp_path, overwrite):
    """The command as a user runs it (its log lines reach stderr): nothing before the one error line."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder")
    import subprocess

    entry = [sys.executable, "-c", "import stagesafe.cli as c; c.run()"]
    command = [*entry, "consolidate", ckpts["s3"]["path"], str(blocker / "out"), "-q", *overwrite]
    result = subprocess.run(command, capture_output=True, text=True, env=sanitized_env(), timeout=120, check=False)
    assert result.returncode == 1, result.stderr
    assert_one_error_line(result.stderr, "notes.txt", "Not a directory")
    assert blocker.read_text() == "a file, not a folder"
