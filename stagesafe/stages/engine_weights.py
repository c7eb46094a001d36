"""A stage's weights taken from its live engine, as the handoff holds them.

The handoff holds the fp32 master of every parameter the engine trained in 16 bits, and every other tensor in
the dtype the module had before its first stage; a 16-bit value the stage left unchanged is given back exactly
as it was, not through a round trip. Taking them is a collective: every rank asks for the same names in the
same order. Two ways: all at once into host memory (:func:`take_from_engine`), or one tensor at a time for a
writer that streams them (:class:`StreamedValues`, when the module holds no weights between stages).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from stagesafe.zero import engine as zero_engine

__all__ = ["StreamedValues", "master_names", "take_from_engine", "to_handoff"]

Original = Mapping[str, tuple[torch.dtype, torch.device]]  # per state-dict name: dtype and device before stage 1


def master_names(module: nn.Module, original: Original) -> set[str]:
    """Parameters whose fp32 masters the live engine holds while the module holds them in 16 bits (built in
    ``configure_model`` under bf16-mixed, or a 16-bit module): the handoff takes the masters."""
    return {
        name
        for name, param in module.named_parameters(remove_duplicate=False)
        if name in original and original[name][0] in (torch.bfloat16, torch.float16)
        and zero_engine.has_fp32_master(param)
    }


def to_handoff(
    original: Original, masters: set[str], entry: Mapping[str, torch.Tensor]
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """What the handoff holds of an engine value: the fp32 master of a name in ``masters``, else the value in
    the module's original dtype; an unchanged 16-bit value gives back the exact ``entry`` value the stage
    started from, not a round trip through 16 bits."""

    def to_original(name: str, value: torch.Tensor) -> torch.Tensor:
        if name in masters:
            return value.to(torch.float32)
        dtype = original.get(name, (value.dtype, None))[0]
        if value.dtype != dtype:
            before = entry.get(name)
            if before is not None and _bitwise_equal(before.to("cpu", value.dtype), value):
                return before.to("cpu", dtype)
        return value.to(dtype)

    return to_original


def take_from_engine(
    module: nn.Module,
    original: Original,
    entry: Mapping[str, torch.Tensor],
    *,
    trained: bool,
    built: set[str],
    host: Mapping[str, torch.Tensor] | None,
    keep_for: Iterable[str] = (),
) -> tuple[dict[str, torch.Tensor], zero_engine.GatheredValues]:
    """The stage's weights (every name of ``original`` the engine's module has): the fp32 masters where the
    engine ``trained``, exact ``entry`` values where unchanged, and gathered partitions for the parameters
    zero.Init ``built`` in this call (only the engine has them). A collective.

    With ``host`` (name -> host tensor made ready for it), masters are copied into those (the module's own,
    page-locked on a GPU) instead of fresh memory; those of ``keep_for`` (the shards this rank writes) stay
    gathered for the writer's private copy (:meth:`~stagesafe.zero.engine.GatheredValues.private_copies`).
    """
    specs, aliases = zero_engine.full_specs(module)
    gathered = zero_engine.GatheredValues(
        module,
        to_handoff(original, master_names(module, original) if trained else set(), entry),
        into=host,
        keep_for=keep_for,
    )
    wanted = set(specs) if trained else built
    gathered.gather_masters([n for n in specs if n in wanted and n not in aliases])
    values: dict[str, torch.Tensor] = {}
    for name in specs:  # the same order on every rank: each lookup is a collective
        if name in aliases:
            values[name] = values[aliases[name]]  # tied: one tensor
        else:
            values[name] = gathered[name] if name in wanted else entry[name]
    gathered.synchronize()
    return {n: values[n] for n in original if n in values}, gathered


class StreamedValues(Mapping):
    """A live engine's weights as the handoff holds them, gathered one tensor at a time as a writer asks for
    them (each a collective, in the same order on every rank), so that host memory stays near one tensor.
    ``specs`` and ``aliases`` are what the writer plans its shards from. :meth:`drain` gathers the names not
    asked for yet: a rank that writes nothing, or whose write failed, still joins every gather the others
    wait in."""

    def __init__(self, module: nn.Module, original: Original, entry: Mapping[str, torch.Tensor]) -> None:
        specs, self.aliases = zero_engine.full_specs(module)
        masters = master_names(module, original)
        self.specs = {
            n: {"dtype": "float32" if n in masters else str(original[n][0]).removeprefix("torch."),
                "shape": list(shape)}
            for n, (shape, _) in specs.items()
            if n in original
        }
        self._gathered = zero_engine.GatheredValues(module, to_handoff(original, masters, entry))
        self._order = [n for n in self.specs if n not in self.aliases]
        self._asked = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        self._asked += 1
        return self._gathered[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def drain(self) -> None:
        """Gather, and drop, every name not asked for yet."""
        for name in self._order[self._asked:]:
            self._gathered[name]
        self._asked = len(self._order)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
