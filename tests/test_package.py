"""The package's import contract, each checked in a fresh interpreter (import order is the point)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("order", ["import stagesafe, lightning.pytorch", "import lightning.pytorch, stagesafe"])
def test_strategy_names_registered_whichever_is_imported_first(order):
    out = _python(f"{order}\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
                  "print(sorted(k for k in StrategyRegistry if k.startswith('stagesafe')))")
    assert out == str(sorted(f"stagesafe_deepspeed_stage_{s}" for s in ("1", "2", "2_offload", "3", "3_offload")))


@pytest.mark.slow
def test_the_command_line_does_not_import_lightning_or_deepspeed():
    out = _python("import sys, stagesafe, stagesafe.cli\nprint('lightning.pytorch' in sys.modules, 'deepspeed' in sys.modules)")
    assert out == "False False"


@pytest.mark.slow
def test_public_functions_stay_functions_after_their_modules_load():
    out = _python("import stagesafe, stagesafe.strategy, stagesafe.consolidate, stagesafe.restore\n"
                  "print(callable(stagesafe.restore), callable(stagesafe.consolidate), stagesafe.StageSafeDeepSpeedStrategy.__name__)")
    assert out == "True True StageSafeDeepSpeedStrategy"
