"""What the pickle reader makes of a global outside its table: an inert stand-in, or a refusal.

The reader imports and calls nothing a file names, whatever the name, so a refusal is not what keeps code from
running; it says that a file holds what no checkpoint needs and every attack does. The line:

- a name in a module that runs code (``os``, ``subprocess``, ``sys``, ``importlib``, ``pickle``, ``ctypes``, ...),
  and every name of ``builtins`` but its types (``eval``, ``exec``, ``getattr``, ``__import__``, ``open``): refused
  wherever it appears, called or not;
- any other name (a class of the user's project, ``__main__.Config``, ``enum`` members, a library's class) is a
  :class:`~stagesafe.zero.pickle_globals.NamedGlobal`, never imported. Instantiated (``NEWOBJ``,
  ``copyreg._reconstructor``) or called (``REDUCE``) it becomes an
  :class:`~stagesafe.zero.pickle_globals.OpaqueRecord` holding the arguments and the state the pickle gives it, if
  its name is a class's (capitalised: ``Color``, ``_Config``); a call of any other name (``tarfile.open``,
  ``mypkg.run``) is a call of a function, which a checkpoint's objects never need: refused.

:data:`RECONSTRUCTOR` is the rule for ``copyreg._reconstructor``, how protocols 0 and 1 instantiate a class.
"""

from __future__ import annotations

import re
from typing import Any

from stagesafe.errors import shown
from stagesafe.zero.pickle_globals import Malformed, NamedGlobal, OpaqueRecord, Refused, Rule

__all__ = ["DENIED_MODULES", "RECONSTRUCTOR", "outside_table"]

# Modules (and their submodules) whose names a checkpoint never holds and attacks do.
DENIED_MODULES = frozenset(
    {
        "os", "posix", "nt", "posixpath", "ntpath", "subprocess", "sys", "importlib", "imp", "runpy", "code",
        "codeop", "pickle", "_pickle", "cPickle", "marshal", "shelve", "shutil", "socket", "ctypes", "_ctypes",
        "multiprocessing", "_posixsubprocess", "signal", "pty", "pdb", "bdb", "webbrowser", "io", "_io", "codecs",
        "tempfile", "functools", "_functools", "operator", "_operator", "types", "inspect", "gc", "copyreg",
        "copy_reg", "threading", "_thread", "asyncio", "select", "selectors", "http", "urllib", "ftplib",
        "smtplib", "telnetlib", "xmlrpc", "zipimport", "pkgutil", "site", "sysconfig", "platform", "resource",
        "fcntl", "mmap", "glob", "fileinput", "dbm", "sqlite3", "ssl", "venv", "ensurepip", "pip", "setuptools",
        "distutils", "_winapi", "msvcrt", "winreg", "nturl2path", "timeit", "trace", "profile",
        "cProfile", "pydoc", "doctest", "unittest", "builtins", "__builtin__",
    }
)  # fmt: skip
# The names of builtins that are types: harmless as values (a field's type, a defaultdict's factory), refused
# when called like any function (torch.save never calls them: lists, dicts and sets have opcodes of their own).
_BUILTIN_TYPES = frozenset(
    {"object", "int", "float", "complex", "str", "bytes", "bytearray", "bool", "list", "tuple", "dict", "set",
     "frozenset", "type", "slice", "range", "NoneType"}
)  # fmt: skip
_CLASS_NAME = re.compile(r"_*[A-Z][A-Za-z0-9_]*")


def outside_table(module: str, name: str) -> Refused | NamedGlobal:
    """What the global ``module.name``, which the reader's table lacks, stands for (see the module docstring)."""
    full = f"{module}.{name}"
    builtin_type = module in ("builtins", "__builtin__") and name in _BUILTIN_TYPES
    if module.partition(".")[0] in DENIED_MODULES and not builtin_type:
        return Refused(full)
    return NamedGlobal(full, class_like=_CLASS_NAME.fullmatch(name.rpartition(".")[2]) is not None)


def _reconstructor(args: tuple) -> Any:
    """``copyreg._reconstructor(cls, object, None)``: an instance of ``cls`` (protocols 0 and 1), its state given
    by a ``BUILD``: a stand-in, or what the table's rule for ``cls`` instantiates."""
    if len(args) != 3:
        raise Malformed(f"copyreg._reconstructor of {len(args)} arguments")
    cls, base, state = args
    for part in (cls, base):
        if isinstance(part, Refused):
            return part
    if not isinstance(base, NamedGlobal) or base._stands_for != "builtins.object" or state is not None:
        raise Malformed(f"copyreg._reconstructor of the base {shown(base, 60)} and state {shown(state, 60)}")
    if isinstance(cls, Rule) and cls.new is not None:
        return cls.new(())
    if not isinstance(cls, NamedGlobal):
        raise Malformed(f"copyreg._reconstructor of {shown(cls, 60)}, which is not a class")
    return OpaqueRecord(cls._stands_for)


RECONSTRUCTOR = Rule("copyreg._reconstructor", call=_reconstructor)
