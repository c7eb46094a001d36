"""The package's import contract, each checked in a fresh interpreter (import order is the point)."""

from __future__ import annotations

import subprocess
import sys

import pytest

NAMES = str(sorted(f"stagesafe_deepspeed_stage_{s}" for s in ("1", "2", "2_offload", "3", "3_offload")))
REGISTERED = "from lightning.pytorch.strategies import StrategyRegistry\nprint(sorted(k for k in StrategyRegistry if k.startswith('stagesafe')))"


def _python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("then", ["import stagesafe.strategy", "stagesafe.StageSafeDeepSpeedStrategy"])
def test_strategy_names_are_registered_when_the_strategy_is_imported(then):
    """Registered as soon as Lightning is imported, each name with a factory that imports the strategy; the
    strategy's import puts the class itself in its place."""
    entry = "print(StrategyRegistry['stagesafe_deepspeed_stage_3']['strategy'].__name__)"
    out = _python(f"import stagesafe, lightning.pytorch\n{REGISTERED}\n{entry}\n{then}\n{REGISTERED}\n{entry}")
    assert out.splitlines() == [NAMES, "_strategy", NAMES, "StageSafeDeepSpeedStrategy"]


@pytest.mark.slow
def test_strategy_names_are_registered_at_import_when_lightning_is_there_first():
    assert _python(f"import lightning.pytorch, stagesafe\n{REGISTERED}") == NAMES


@pytest.mark.slow
def test_strategy_names_are_registered_when_stagesafe_is_imported_before_lightning():
    """The other order: ``import stagesafe`` first, then Lightning; a Trainer built by name gets the strategy
    with the name's arguments."""
    build = ("import lightning.pytorch as pl\n"
             "t = pl.Trainer(strategy='stagesafe_deepspeed_stage_3_offload', accelerator='cpu', devices=2,\n"
             "               logger=False)\n"
             "z = t.strategy.config['zero_optimization']\n"
             "print(type(t.strategy).__name__, z['stage'], z['offload_param']['device'],\n"
             "      z['offload_optimizer']['device'])")
    out = _python(f"import stagesafe\nimport lightning.pytorch\n{REGISTERED}\n{build}")
    assert out.splitlines()[0] == NAMES
    assert out.splitlines()[-1] == "StageSafeDeepSpeedStrategy 3 cpu cpu"


@pytest.mark.slow
def test_the_import_observer_finds_no_module_and_leaves_once_the_strategy_is_imported():
    """What ``import stagesafe`` adds to ``sys.meta_path`` before Lightning is there finds nothing (every import
    goes to the finders that were there), and it is gone once the strategy is imported."""
    out = _python(
        "import sys\nbefore = list(sys.meta_path)\nimport stagesafe\n"
        "added = [f for f in sys.meta_path if f not in before]\n"
        "print(len(added), [f.find_spec(n) for f in added for n in ('json', 'lightning.pytorch', 'stagesafe.cli')])\n"
        "import lightning.pytorch, stagesafe.strategy\nprint(any(f in sys.meta_path for f in added))"
    )
    assert out.splitlines() == ["1 [None, None, None]", "False"]


@pytest.mark.slow
def test_the_package_and_the_command_line_import_no_torch_lightning_or_deepspeed():
    out = _python("import sys, stagesafe, stagesafe.cli\nprint([m for m in ('torch', 'lightning', 'deepspeed') if m in sys.modules])")
    assert out == "[]"


@pytest.mark.slow
def test_public_functions_stay_functions_after_their_modules_load():
    out = _python("import stagesafe, stagesafe.strategy, stagesafe.consolidate, stagesafe.restore\n"
                  "print(callable(stagesafe.restore), callable(stagesafe.consolidate), stagesafe.StageSafeDeepSpeedStrategy.__name__)")
    assert out == "True True StageSafeDeepSpeedStrategy"


@pytest.mark.slow
def test_every_public_name_resolves():
    out = _python("import stagesafe\nprint(all(getattr(stagesafe, n) is not None for n in stagesafe.__all__), 'consolidate' in dir(stagesafe))")
    assert out == "True True"


def test_dir_lists_the_public_names_and_no_helper_the_package_imports():
    out = _python("import stagesafe\nprint(' '.join(dir(stagesafe)))").split()
    assert {"StageSafeDeepSpeedStrategy", "load_state_dict", "EngineReleasedError", "__version__"} <= set(out)
    assert not {"Any", "annotations", "importlib", "sys", "types"} & set(out)
    assert all(name in __import__("stagesafe").__all__ or name == "errors" for name in out)
