"""LightningCLI selects stagesafe by its registered name or by class path, from YAML or the command line.

The parsing tests build the Trainer in this process (``run=False``: no stage runs); one end-to-end run
selects the strategy by name on the command line and runs fit then test on 2 CPU ranks.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from _launch import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
SCRIPT = os.path.join(EXAMPLES, "lightning_cli.py")
NAME_YAML = os.path.join(EXAMPLES, "lightning_cli.yaml")
CLASS_PATH_YAML = os.path.join(EXAMPLES, "lightning_cli_class_path.yaml")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("stagesafe_lightning_cli_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cli(example, tmp_path, monkeypatch):
    """Parse like ``python examples/lightning_cli.py ARGS`` and build model, data and Trainer; run nothing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", [SCRIPT])  # LightningCLI warns when pytest's own arguments are there too
    saved_env = dict(os.environ)  # seed_everything and Lightning's connectors write variables

    def parse(*args: str):
        from lightning.pytorch.cli import LightningCLI

        return LightningCLI(
            example.TinyLM, example.TokenData, run=False, args=list(args), save_config_callback=None,
            trainer_defaults={"logger": False},
        )

    yield parse
    os.environ.clear()
    os.environ.update(saved_env)


def _zero(strategy) -> dict:
    return strategy.config["zero_optimization"]


@pytest.mark.parametrize(
    "name,stage,offload",
    [
        ("stagesafe_deepspeed_stage_1", 1, False),
        ("stagesafe_deepspeed_stage_2", 2, False),
        ("stagesafe_deepspeed_stage_3", 3, False),
        ("stagesafe_deepspeed_stage_2_offload", 2, True),
        ("stagesafe_deepspeed_stage_3_offload", 3, True),
    ],
)
def test_registered_name_on_the_command_line(cli, name, stage, offload):
    import stagesafe

    parsed = cli(f"--trainer.strategy={name}", "--trainer.accelerator=cpu", "--trainer.devices=2")
    strategy = parsed.trainer.strategy
    assert type(strategy) is stagesafe.StageSafeDeepSpeedStrategy
    assert _zero(strategy)["stage"] == stage
    assert ("offload_optimizer" in _zero(strategy)) is offload
    assert strategy.handoff_uri is None and strategy.storage_options == {}


def test_registered_name_in_yaml(cli):
    import stagesafe

    parsed = cli("--config", NAME_YAML)
    assert type(parsed.trainer.strategy) is stagesafe.StageSafeDeepSpeedStrategy
    assert _zero(parsed.trainer.strategy)["stage"] == 3
    assert parsed.trainer.num_devices == 2


def test_class_path_yaml_reaches_every_argument(cli):
    parsed = cli("--config", CLASS_PATH_YAML)
    strategy = parsed.trainer.strategy
    assert _zero(strategy)["stage"] == 3
    assert strategy.handoff_uri == "lightning_logs/stagesafe_cli_class_path/handoff"
    assert strategy.max_shard_size == "5GB"


def test_class_path_arguments_from_the_command_line(cli):
    parsed = cli(
        "--config", CLASS_PATH_YAML,
        "--trainer.strategy.init_args.handoff_uri=s3://bucket/run1/handoff",
        '--trainer.strategy.init_args.storage_options={"endpoint_url": "http://127.0.0.1:9000", "anon": false}',
        "--trainer.strategy.init_args.max_shard_size=500MB",
        "--trainer.strategy.init_args.offload_optimizer=true",
    )
    strategy = parsed.trainer.strategy
    assert strategy.handoff_uri == "s3://bucket/run1/handoff"  # a str URL, never collapsed by a Path
    assert strategy.storage_options == {"endpoint_url": "http://127.0.0.1:9000", "anon": False}
    assert strategy.max_shard_size == "500MB"
    assert "offload_optimizer" in _zero(strategy)


def test_short_class_name_with_init_args(cli):
    import stagesafe

    parsed = cli(
        "--trainer.strategy=StageSafeDeepSpeedStrategy", "--trainer.strategy.stage=2",
        "--trainer.strategy.handoff_uri=memory://handoff", "--trainer.accelerator=cpu",
    )
    assert type(parsed.trainer.strategy) is stagesafe.StageSafeDeepSpeedStrategy
    assert _zero(parsed.trainer.strategy)["stage"] == 2
    assert parsed.trainer.strategy.handoff_uri == "memory://handoff"


def test_resume_from_is_a_cli_argument(cli):
    parsed = cli("--config", CLASS_PATH_YAML, "--trainer.strategy.init_args.resume_from=s3://bucket/run1/handoff")
    assert parsed.trainer.strategy.resume_from == "s3://bucket/run1/handoff"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_name_on_the_command_line_runs_fit_then_test(tmp_path):
    """``--trainer.strategy=stagesafe_deepspeed_stage_3`` end to end: fit, then test on the same module."""
    result = run_script(
        SCRIPT,
        ["fit", "--config", NAME_YAML, "--trainer.strategy=stagesafe_deepspeed_stage_3",
         f"--trainer.default_root_dir={tmp_path}"],
        timeout=200, cwd=str(tmp_path),
    )
    handoff = f"{tmp_path}/stagesafe_handoff"  # the default: <default_root_dir>/stagesafe_handoff
    assert "strategy: StageSafeDeepSpeedStrategy (ZeRO stage 3, 2 ranks)" in result.stdout
    assert f"handoff: {handoff} (1 shard(s), written by 'fit' at step 8)" in result.stdout
    assert "test_loss:" in result.stdout
    boundary_lines = [line for line in result.stderr.splitlines() if line.startswith("INFO stagesafe")]
    assert [line.split("stagesafe: ", 1)[1].split()[0] for line in boundary_lines] == ["fit", "test"]
