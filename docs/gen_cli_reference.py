"""Generate the CLI reference page from ``stagesafe.cli.build_parser()``, so the page can never go stale.

Two ways in:
- as an mkdocs hook (``hooks:`` in ``mkdocs.yml``): ``on_files`` adds ``cli-reference.md`` to the build, generated
  in memory; nothing is written to ``docs/``;
- as a script, to read the page without building the site: ``python docs/gen_cli_reference.py [OUT.md]``
  (standard output when OUT is left out).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

PAGE = "cli-reference.md"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parser() -> argparse.ArgumentParser:
    if _REPO not in sys.path:  # the checkout's stagesafe, also when it is not installed
        sys.path.insert(0, _REPO)
    from stagesafe.cli import build_parser

    return build_parser()


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if "`" not in text else f"`` {text} ``"


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        return _code(action.metavar or action.dest)
    takes_value = action.nargs != 0
    shown = []
    for opt in action.option_strings:
        if takes_value:
            value = action.metavar or ("{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper())
            shown.append(_code(f"{opt} {value}"))
        else:
            shown.append(_code(opt))
    return ", ".join(shown)


def _default(action: argparse.Action) -> str:
    if not action.option_strings or action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        return ""
    return _code(str(action.default))


def _arguments_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:  # argparse has no public accessor; sphinx-argparse reads the same list
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        help_text = action.help or ""
        if action.option_strings and action.choices and action.nargs != 0 and action.metavar is not None:
            help_text += f" (one of {', '.join(map(str, action.choices))})"  # the metavar hides them
        if isinstance(action, argparse._AppendAction):
            help_text += " (repeatable)" if "repeatable" not in help_text else ""
        rows.append(f"| {_invocation(action)} | {_cell(help_text)} | {_default(action)} |")
    if not rows:
        return []
    return ["| argument | meaning | default |", "| --- | --- | --- |", *rows, ""]


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, sub, helps.get(name, "")) for name, sub in action.choices.items()]
    return []


def _usage(parser: argparse.ArgumentParser) -> str:
    # argparse wraps at the terminal's width ($COLUMNS); fix it so the page does not depend on who builds it
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        return parser.format_usage().strip()
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page, as Markdown."""
    parser = parser or _parser()
    prog = parser.prog
    subs = _subcommands(parser)
    intro = (
        f"Generated from `stagesafe.cli.build_parser()` at every docs build, so it matches the installed `{prog}` "
        f"exactly. For the why and the how (what SRC may be, the exit codes, memory), see [The `{prog}` command](cli.md)."
    )
    lines = [
        "# CLI reference",
        "",
        intro,
        "",
        "```text",
        _usage(parser),
        "```",
        "",
        parser.description or "",
        "",
        "Subcommands:",
        "",
    ]
    lines += [f"- [`{prog} {name}`](#{prog}-{name}): {help_text}" for name, _, help_text in subs]
    lines += ["", "Global options (before `COMMAND`):", ""]
    lines += _arguments_table(parser)
    for name, sub, _help in subs:
        lines += [f"## `{prog} {name}` {{#{prog}-{name}}}", "", "```text", _usage(sub), "```", ""]
        if sub.description:
            lines += [sub.description, ""]
        lines += _arguments_table(sub)
        if sub.epilog:
            lines += ["```text", sub.epilog.rstrip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


# -- mkdocs hook and script ------------------------------------------------------------------------------------


def page_hook(page: str, render: Callable[[], str], doc: str) -> tuple[Callable, Callable]:
    """``(on_files, main)`` for a page generated by ``render()``: the mkdocs hook that adds it to the build in
    memory (a stale hand-written copy must not win), and the script that writes it to a file or stdout."""

    def on_files(files, config):
        from mkdocs.structure.files import File

        existing = files.get_file_from_path(page)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, page, content=render()))
        return files

    def main(argv: list[str] | None = None) -> int:
        args = argparse.ArgumentParser(description=doc.splitlines()[0])
        args.add_argument("out", nargs="?", help="file to write (default: standard output)")
        out = args.parse_args(argv).out
        text = render()
        if out:
            with open(out, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
        return 0

    return on_files, main


on_files, main = page_hook(PAGE, lambda: render(), __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
