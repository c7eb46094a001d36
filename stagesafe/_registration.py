"""The strategy's names in Lightning's ``StrategyRegistry`` (``Trainer(strategy="stagesafe_deepspeed_stage_3")``),
registered whichever of ``import stagesafe`` and ``import lightning`` comes first.

Lightning first: ``import stagesafe`` imports the strategy, which registers its names. stagesafe first: it must not
import Lightning (the ``stagesafe`` command runs without torch), so :func:`register_once_lightning_loads` puts an
observer on ``sys.meta_path``. The observer finds no module and wraps no loader: it returns ``None`` for every
name, and at the first import after Lightning's registry is whole it registers each name with a factory that
imports the strategy when a Trainer asks for it; from then on it does nothing, and the strategy's import removes it.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["NAMES", "register", "register_once_lightning_loads", "stop_observing"]

_REGISTRY_MODULE = "lightning.pytorch.strategies"

# registered name -> (description, the strategy's arguments)
NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    **{f"stagesafe_deepspeed_stage_{n}": (f"ZeRO stage {n}", {"stage": n}) for n in (1, 2, 3)},
    "stagesafe_deepspeed_stage_2_offload": (
        "ZeRO stage 2 with CPU optimizer offload", {"stage": 2, "offload_optimizer": True}
    ),
    "stagesafe_deepspeed_stage_3_offload": (
        "ZeRO stage 3 with CPU offload", {"stage": 3, "offload_optimizer": True, "offload_parameters": True}
    ),
}


def register(registry: Any, strategy: Any) -> None:
    """Register every name of :data:`NAMES` in ``registry``, built by ``strategy`` (the class, or a factory)."""
    for name, (description, arguments) in NAMES.items():
        registry.register(name, strategy, description=f"stagesafe: DeepSpeed {description}", override=True, **arguments)


def _strategy(**arguments: Any) -> Any:
    """The factory a name is registered with before the strategy is imported: the package's public name imports
    it (which registers the class itself), and it builds it."""
    return getattr(sys.modules[__package__], "StageSafeDeepSpeedStrategy")(**arguments)


class _RegisterWhenLightningLoads:
    """On ``sys.meta_path``, first: consulted for every module not imported yet, it finds none (``None``); once
    Lightning's strategy registry has been imported whole, it registers the names, then stays idle."""

    done = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if self.done:
            return None
        module = sys.modules.get(_REGISTRY_MODULE)
        spec = getattr(module, "__spec__", None)
        if module is None or getattr(spec, "_initializing", False) or not hasattr(module, "StrategyRegistry"):
            return None
        self.done = True  # before registering: nothing below imports, but a failure must not repeat at every import
        register(module.StrategyRegistry, _strategy)
        return None

    def invalidate_caches(self) -> None:
        pass


def register_once_lightning_loads() -> None:
    """Install the observer (once), unless Lightning's registry is already there (then the caller imports the
    strategy, which registers)."""
    if not any(isinstance(finder, _RegisterWhenLightningLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenLightningLoads())


def stop_observing() -> None:
    """Remove the observer: the strategy is imported and its names are registered. Not called from ``find_spec``
    (the import system walks ``sys.meta_path`` while it is consulted)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _RegisterWhenLightningLoads)]
