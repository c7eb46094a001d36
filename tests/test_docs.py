"""The documentation site builds with ``mkdocs build --strict`` and its reference pages cover the real API.

The CLI reference is generated from ``stagesafe.cli.build_parser()`` at build time; the strategy page is
written by hand, so a test checks that it names every argument the class accepts.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _read(name: str) -> str:
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_cli_reference", os.path.join(DOCS, "gen_cli_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _mkdocs_config() -> dict:
    class _Loader(yaml.SafeLoader):  # mkdocs.yml may hold !!python/name tags; none are needed here
        pass

    _Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        return yaml.load(f, Loader=_Loader)


def test_every_page_in_the_nav_exists():
    generated = {"cli-reference.md", "api-reference.md"}
    missing = [p for p in _nav_pages(_mkdocs_config()["nav"]) if p not in generated and not os.path.isfile(os.path.join(DOCS, p))]
    assert not missing, f"pages in mkdocs.yml's nav that docs/ lacks: {missing}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", os.path.join(ROOT, "mkdocs.yml"),
         "--site-dir", str(site)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=170,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's end-of-life banner
    )
    assert result.returncode == 0, result.stderr[-6000:]
    assert not [line for line in result.stderr.splitlines() if line.startswith("WARNING")], result.stderr
    html = (site / "cli-reference" / "index.html").read_text(encoding="utf-8")
    for flag in ("--max-shard-size", "--storage-option", "--overwrite", "--exclude-frozen", "--json"):
        assert flag in html
    assert not (site / "gen_cli_reference.py").exists()  # the generator is not published as a page asset
    api = (site / "api-reference" / "index.html").read_text(encoding="utf-8")
    import stagesafe

    for name in stagesafe.__all__:  # every public name, with its docstring's first line
        if name != "__version__":
            assert name in api, f"{name} missing from the API reference"
    assert "keep_optimizer_state" in api and "EngineReleasedError" in api
    assert not os.path.exists(os.path.join(DOCS, "cli-reference.md"))  # generated in memory, never a stale copy


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_cli_reference_covers_every_subcommand_option_and_example(generator):
    from stagesafe.cli import build_parser

    page = generator.render(build_parser())
    for parser in _parsers(build_parser()):
        assert f"`{parser.prog}`" in page or f"`{parser.prog} " in page or parser.prog == "stagesafe"
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}" in page, f"{parser.prog}: {option} missing from the CLI reference"
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                assert f"`{action.metavar or action.dest}`" in page
            if action.help and action.help != argparse.SUPPRESS:
                assert " ".join(action.help.split()).replace("|", "\\|") in page
        for line in (parser.epilog or "").splitlines():
            assert line.rstrip() in page


@pytest.mark.slow
def test_cli_reference_script_writes_the_page(tmp_path, generator):
    out = tmp_path / "cli-reference.md"
    subprocess.run([sys.executable, os.path.join(DOCS, "gen_cli_reference.py"), str(out)], check=True, cwd=ROOT)
    from stagesafe.cli import build_parser

    assert out.read_text(encoding="utf-8") == generator.render(build_parser())


def test_strategy_page_documents_every_argument():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    import stagesafe

    page = _read("strategy.md")
    names = set()
    for cls in (stagesafe.StageSafeDeepSpeedStrategy, DeepSpeedStrategy):
        for name, param in inspect.signature(cls.__init__).parameters.items():
            if name != "self" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                names.add(name)
    undocumented = sorted(n for n in names if f"`{n}`" not in page)
    assert not undocumented, f"docs/strategy.md does not mention these arguments: {undocumented}"


def test_strategy_page_lists_every_registered_name():
    from lightning.pytorch.strategies import StrategyRegistry

    import stagesafe.strategy  # noqa: F401 (registers)

    names = [n for n in StrategyRegistry.available_strategies() if n.startswith("stagesafe")]
    assert len(names) == 5
    page = _read("strategy.md")
    assert all(f"`{n}`" in page for n in names)


def test_every_error_on_why_page_links_to_its_fix():
    page = _read("why-zero3-breaks.md")
    errors = page.split("## The errors", 1)[1].split("\n## ", 1)[0]
    sections = re.split(r"\n### ", errors)[1:]
    assert len(sections) >= 7
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"\{#[a-z0-9-]+\}$", title), f"no stable anchor: {title}"
        assert "```text\n" in section, f"no verbatim message: {title}"
        assert "**Fix:**" in section and re.search(r"\]\([a-z0-9-]+\.md(#[a-z0-9-]+)?\)", section), title


_SHARD_NAME = re.compile(r"model-[^\s`'\"*)]*?\.safetensors")
_TAGGED = re.compile(r"model-(?:[0-9a-f]{8}|<tag>)-(?:\d{5}|<i>|0000i)-of-(?:\d{5}|<n>|0000n)\.safetensors")


def test_the_shard_names_docs_and_help_show_are_the_names_written():
    """Shards are model-<tag>-0000i-of-0000n.safetensors: what the docs and --help show has the tag too (only the
    sentence on handoffs written before tags names the old form)."""
    import contextlib
    import io

    from stagesafe.cli import main

    texts = {os.path.relpath(p, ROOT): open(p, encoding="utf-8").read()
             for p in [os.path.join(ROOT, "README.md"), *(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))]}
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text):
        main(["consolidate", "--help"])
    texts["stagesafe consolidate --help"] = help_text.getvalue()
    wrong = []
    for where, text in texts.items():
        for line in text.splitlines():
            for name in _SHARD_NAME.findall(line):
                if not _TAGGED.fullmatch(name) and "still read" not in line and name != "model-...safetensors":
                    wrong.append(f"{where}: {name}")
    assert not wrong, wrong
