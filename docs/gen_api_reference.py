"""Generate the Python API reference page from ``stagesafe.__all__``: signatures and docstrings as the code has them.

Two ways in, as ``gen_cli_reference.py``:
- as an mkdocs hook (``hooks:`` in ``mkdocs.yml``): ``on_files`` adds ``api-reference.md`` to the build, generated
  in memory;
- as a script: ``python docs/gen_api_reference.py [OUT.md]`` (standard output when OUT is left out).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

PAGE = "api-reference.md"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SECTIONS = (
    ("The strategy", lambda obj: inspect.isclass(obj) and not issubclass(obj, BaseException) and hasattr(obj, "setup")),
    ("Functions", inspect.isfunction),
    ("Classes", lambda obj: inspect.isclass(obj) and not issubclass(obj, BaseException)),
    ("Errors", lambda obj: inspect.isclass(obj) and issubclass(obj, BaseException)),
)


def _public() -> dict[str, object]:
    if _REPO not in sys.path:  # the checkout's stagesafe, also when it is not installed
        sys.path.insert(0, _REPO)
    import stagesafe

    return {name: getattr(stagesafe, name) for name in stagesafe.__all__ if name != "__version__"}


def _signature(name: str, obj: object) -> str:
    try:
        signature = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)  # type: ignore[misc]
    except (TypeError, ValueError):
        return name
    return f"{name}({', '.join(_parameter(p) for p in signature.parameters.values() if p.name != 'self')})"


def _parameter(p: inspect.Parameter) -> str:
    """``name: annotation = default``, the annotation as written (a string under postponed annotations)."""
    text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
    if p.annotation is not p.empty:
        text += f": {p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)}"
    if p.default is not p.empty:
        text += f" = {p.default!r}"
    return text


def _doc(obj: object) -> list[str]:
    """The docstring as written, in a text block: its indented argument lists would not survive Markdown."""
    doc = inspect.getdoc(obj)
    return ["```text", doc, "```", ""] if doc else []


def _members(cls: type) -> list[str]:
    """Public methods and properties the class and its stagesafe bases define (not Lightning's), with their
    docstrings."""
    own: dict[str, object] = {}
    for base in reversed(cls.__mro__):  # the class's own definition wins over its bases'
        if base is cls or base.__module__.startswith("stagesafe."):
            own.update(vars(base))
    lines = []
    for attr, value in sorted(own.items()):
        if attr.startswith("_") or not (inspect.isfunction(value) or isinstance(value, property)):
            continue
        if not inspect.getdoc(value):
            continue
        kind = "property" if isinstance(value, property) else "method"
        call = attr if kind == "property" else _signature(attr, value)
        lines += [f"#### `{call}` ({kind})", "", *_doc(value)]
    return lines


def render() -> str:
    public = _public()
    lines = [
        "# Python API reference",
        "",
        "Generated from the code's signatures and docstrings at build time (`docs/gen_api_reference.py`): "
        "every name `import stagesafe` exports. The guides explain when to use what: the "
        "[strategy page](strategy.md) has every argument in detail.",
        "",
    ]
    done: set[str] = set()
    for title, wanted in _SECTIONS:
        names = [n for n, obj in public.items() if n not in done and wanted(obj)]
        if not names:
            continue
        lines += [f"## {title}", ""]
        for name in names:
            obj = public[name]
            done.add(name)
            lines += [f"### `{_signature(name, obj)}`" if not issubclass_error(obj) else f"### `{name}`", ""]
            lines += _doc(obj)
            if inspect.isclass(obj) and not issubclass_error(obj):
                lines += _members(obj)
    return "\n".join(lines).rstrip() + "\n"


def issubclass_error(obj: object) -> bool:
    return inspect.isclass(obj) and issubclass(obj, BaseException)


# -- mkdocs hook and script ------------------------------------------------------------------------------------

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_cli_reference import page_hook  # noqa: E402 - the sibling hook, loaded by path as mkdocs loads hooks

on_files, main = page_hook(PAGE, render, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
