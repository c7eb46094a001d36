"""_registration.py: the strategy's names in Lightning's registry, whichever of ``import stagesafe`` and
``import lightning`` comes first; each name builds the strategy with its arguments."""

from __future__ import annotations

import subprocess
import sys

from stagesafe._registration import NAMES, register


class _Registry(dict):
    def register(self, name, strategy, *, description, override, **arguments):
        self[name] = (strategy, description, override, arguments)


def test_every_name_is_registered_with_its_arguments_and_a_description():
    registry = _Registry()
    register(registry, "factory")
    assert set(registry) == set(NAMES)
    for name, (description, arguments) in NAMES.items():
        assert registry[name] == ("factory", f"stagesafe: DeepSpeed {description}", True, arguments)


def _names_after(imports: str) -> str:
    code = (f"{imports}\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
            "import stagesafe._registration as r\nprint(sorted(set(r.NAMES) - set(StrategyRegistry)))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_the_names_are_there_whichever_is_imported_first():
    assert _names_after("import stagesafe\nimport lightning.pytorch") == "[]"
    assert _names_after("import lightning.pytorch\nimport stagesafe") == "[]"
