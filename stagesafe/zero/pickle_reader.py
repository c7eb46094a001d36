"""DeepSpeed's and Lightning's pickles, read by an interpreter of the few opcodes ``torch.save`` writes: nothing in
a file runs, and reading any file takes time and memory linear in its size.

``torch.save`` writes a zip archive: ``<name>/data.pkl``, a pickle (protocol 2) of the saved object's structure,
and one record ``<name>/data/<key>`` of raw bytes per tensor storage. Every unpickler, torch's weights-only one
included, turns the globals a pickle names into real callables and calls them. This one never imports or calls
anything a file names, and needs no torch: it interprets the binary opcodes of protocols 2 to 5 that build data
(numbers, strings, containers, the memo, marks). A ``GLOBAL`` is looked up in fixed tables: torch's, DeepSpeed's
and Lightning's names (:mod:`stagesafe.zero.pickle_globals`: a tensor comes out as a
:class:`~stagesafe.zero.pickle_globals.TensorRecord`, which says where its bytes are; nothing is read here), and
the values users keep in hyperparameters (:mod:`stagesafe.zero.pickle_user_values`: paths, numpy values,
datetimes, namespaces, built by constructors of ours from checked arguments). ``REDUCE``, ``NEWOBJ`` and
``BUILD`` apply a table's rules to plain values. Any other name is judged by :mod:`stagesafe.zero.pickle_policy`:
a class of the user's becomes an inert :class:`~stagesafe.zero.pickle_globals.OpaqueRecord` (the logger
``stagesafe.zero.pickle_reader`` warns, naming it), a name in a module that runs code, or a call of a function,
is refused.

Refused with :class:`~stagesafe.errors.UnsafeCheckpointError` (nothing was run, since nothing ever is): those
names (every one the pickle holds is listed), an opcode outside the subset (``INST``, ``OBJ``, ``EXT1``, the text
opcodes of protocol 0, out-of-band buffers). Refused with :class:`~stagesafe.errors.CheckpointFormatError`:
malformed input (truncated, an empty stack, a memo slot never set, arguments a rule refuses, a dict key or set
item that is not a plain value, an integer of more than 64 bytes), and a pickle that would pass the bounds of
:mod:`stagesafe.zero.pickle_limits` (memory charged per opcode and per call, keys of one hash). The interpreter
(:mod:`stagesafe.zero.pickle_interpreter`; this module is its entry point and its messages) is a loop, never a
recursion, and hashes only flat keys, so no input nests it out of its stack.

``trusted=True`` is for a file its user vouches for: nothing is refused (every name outside the tables is a
stand-in, no warning), so that the caller may load the real objects with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

from stagesafe.errors import CheckpointFormatError, UnsafeCheckpointError, clip
from stagesafe.zero.pickle_globals import Malformed
from stagesafe.zero.pickle_interpreter import Interpreter, OutsideSubset
from stagesafe.zero.pickle_limits import MEMORY_BASE, OverLimit

__all__ = ["TRUST_VARIABLE", "read_pickle"]

TRUST_VARIABLE = "STAGESAFE_TRUST_PICKLES"

log = logging.getLogger(__name__)


# Why an opcode outside the subset is refused (the others are text opcodes of protocols 0 and 1).
_CALLS_CODE = {ord("i"): "INST", ord("o"): "OBJ", 0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", ord("P"): "PERSID"}


def read_pickle(data: bytes, *, display: str, trusted: bool = False) -> Any:
    """The value the pickle ``data`` (a ``torch.save`` archive's ``data.pkl``) describes, tensors as
    :class:`TensorRecord`, objects of classes outside the tables as stand-ins (a warning names them). ``display``
    names the file in errors. Raises :class:`~stagesafe.errors.UnsafeCheckpointError` or
    :class:`~stagesafe.errors.CheckpointFormatError` as the module says; runs nothing the pickle names.
    ``trusted``: refuse no name and warn of no stand-in (the caller loads the real objects otherwise)."""
    reader = Interpreter(data, trusted=trusted, memory_base=MEMORY_BASE)
    try:
        value = reader.run()
    except OutsideSubset as exc:
        code, at = exc.args
        raise UnsafeCheckpointError(_refusal(display, reader.refused, _opcode(code, at))) from None
    except (Malformed, OverLimit, IndexError, KeyError, TypeError, ValueError, OverflowError, struct.error) as exc:
        if reader.refused:  # whatever broke next, a refused global says more
            raise UnsafeCheckpointError(_refusal(display, reader.refused)) from None
        known = isinstance(exc, (Malformed, OverLimit))
        detail = clip(str(exc), 300) if known else f"{type(exc).__name__}: {clip(str(exc), 160)}"
        raise CheckpointFormatError(
            f"{display} cannot be read as a torch checkpoint file ({detail}, at byte {reader.at} of its pickle); "
            "it is damaged, truncated or not a checkpoint DeepSpeed wrote: was it written or copied completely?"
        ) from None
    if reader.refused:
        raise UnsafeCheckpointError(_refusal(display, reader.refused))
    if reader.stand_ins:
        log.warning(_stand_ins(display, reader.stand_ins))
    return value


def _opcode(code: int, at: int) -> str:
    name = _CALLS_CODE.get(code)
    if name is not None:
        return f"the opcode {name} at byte {at}, which would call or look up code"
    import pickletools  # the error path only: its table of opcodes takes a moment to build

    names = {op.code.encode("latin1")[0]: op.name for op in pickletools.opcodes}
    what = names.get(code, f"0x{code:02x}")
    return f"the opcode {what} at byte {at}, which torch.save does not write"


def _listed(names: dict[str, str]) -> str:
    """The first names, each with why it is listed."""
    listed = ", ".join(repr(clip(name, 100)) + why for name, why in list(names.items())[:8])
    return listed + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _refusal(display: str, refused: dict[str, str], opcode: str | None = None) -> str:
    if refused:
        what = ("the global " if len(refused) == 1 else "the globals ") + _listed(refused)
        return (
            f"refused to load {display}: it holds {what}, which stagesafe never loads from a checkpoint file (names "
            "of modules that run code, such as os, subprocess or builtins' eval, and calls of functions); nothing "
            "from the file was executed. A file written by DeepSpeed or Lightning does not need them: if you did not "
            f"make this file yourself, do not trust it; if you did and trust it, {TRUST_VARIABLE}=1 loads it with "
            "torch.load(weights_only=False), which runs code from it"
        )
    return (
        f"refused to load {display}: it holds {opcode}; nothing from the file was executed. A file written by "
        "DeepSpeed or Lightning does not hold it: if you did not make this file yourself, do not trust it"
    )


def _stand_ins(display: str, names: dict[str, str]) -> str:
    return (
        f"{display}: {_listed(names)}, which stagesafe does not import, became inert stand-ins (OpaqueRecord: the "
        "name, the arguments and the pickled attributes; no code runs); the weights do not need them. If you trust "
        f"this file and need the real objects, {TRUST_VARIABLE}=1 loads them with torch.load(weights_only=False), "
        "which runs code from it"
    )
