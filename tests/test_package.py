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
    out = _python(f"import stagesafe, lightning.pytorch\n{REGISTERED}\n{then}\n{REGISTERED}")
    assert out.splitlines() == ["[]", NAMES]


@pytest.mark.slow
def test_strategy_names_are_registered_at_import_when_lightning_is_there_first():
    assert _python(f"import lightning.pytorch, stagesafe\n{REGISTERED}") == NAMES


@pytest.mark.slow
def test_import_installs_no_import_hook():
    out = _python("import sys\nbefore = list(sys.meta_path)\nimport stagesafe\nprint(sys.meta_path == before)")
    assert out == "True"


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
