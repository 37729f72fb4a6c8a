"""The reference pages that follow the code: docs/reference/cli.md is what the tools' parsers generate, and
docs/reference/metrics.md names only metrics the code writes and every figure the loops log."""

from __future__ import annotations

import argparse
import ast
import re

from astrai.__main__ import TOOLS, main, tool_docs
from astrai.config.cli_docs import render_cli_reference, render_tool
from tests.conftest import REPO

CLI_PAGE = REPO / "docs/reference/cli.md"
METRICS_PAGE = REPO / "docs/reference/metrics.md"
PACKAGE = REPO / "astrai"
PLACEHOLDER = re.compile(r"<[a-z]+>")


def test_cli_reference_is_up_to_date():
    assert CLI_PAGE.read_text() == render_cli_reference(tool_docs()), (
        "regenerate: python -m astrai cli-docs > docs/reference/cli.md"
    )


def test_every_tool_has_a_section_a_purpose_and_its_flags():
    written = CLI_PAGE.read_text()
    documented = tool_docs()
    assert [tool for tool, _, _ in documented] and {tool for tool, _, _ in documented} == set(TOOLS)
    for tool, purpose, parser in documented:
        assert purpose, f"{tool}: no line in astrai/__main__.py's docstring (the help)"
        assert f"## `{tool}`" in written and f"python -m astrai {tool}" in written, tool
        shown = [action for action in (parser._actions if parser else []) if action.help is not argparse.SUPPRESS]
        for name in [name for action in shown for name in action.option_strings if name not in ("-h", "--help")]:
            assert f"`{name}`" in written, f"{tool} {name} missing from docs/reference/cli.md"


def test_the_cli_docs_tool_prints_the_page(capsys):
    assert main(["cli-docs"]) == 0
    assert capsys.readouterr().out == CLI_PAGE.read_text()


def test_a_tool_section_renders_flags_defaults_and_help():
    parser = argparse.ArgumentParser(prog="ignored", description="Does <N> things.")
    parser.add_argument("path", help="where")
    parser.add_argument("--mode", choices=("a", "b"), default="a", help="a | b (default %(default)s)")
    parser.add_argument("--flag", action="store_true", help="on")
    parser.add_argument("--set", action="append", default=[], metavar="K=V", help="override")
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    text = render_tool("demo", "demo things (docs/guides/x.md)", parser)
    assert "Demo things ([guides/x.md](../guides/x.md))." in text and "Does &lt;N&gt; things." in text
    assert "python -m astrai demo [-h] [--mode {a,b}] [--flag] [--set K=V] path" in text
    assert "| `path` | **required** | where |" in text
    assert "| `--mode` {a,b} | `a` | a \\| b (default a) |" in text
    assert "| `--flag` | `false` | on |" in text and "| `--set` K=V (repeatable) | (none) | override |" in text
    assert "--hidden`" not in text and "`-h`" not in text
    assert "Takes no arguments." in render_tool("bare", "nothing", None)


# ----------------------------------------------------------------------------- metrics


def _metric_names() -> list[str]:
    """The first cell of every table row of docs/reference/metrics.md (its code span): the metric names."""
    names = []
    for line in METRICS_PAGE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        match = re.fullmatch(r"`([^`]+)`", cells[0]) if cells else None
        if match:
            names.append(match[1])
    return names


def _code_strings() -> set[str]:
    """Every string literal under astrai/, f-strings as their fixed pieces, and the keywords of every
    `record.update(name=...)` (the loops log most step figures that way)."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
            elif _is_record_update(node):
                found |= {keyword.arg for keyword in node.keywords if keyword.arg}
    return found


def _is_record_update(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == "update"
        and getattr(node.func.value, "id", None) == "record"
    )


def _written(name: str, strings: set[str]) -> bool:
    """A plain name is a string literal of the code; `eval/<name>` is <name> (the evaluator prefixes it); a name
    with placeholders (`<part>_grad_norm`) has each fixed piece inside a literal (an f-string's pieces)."""
    if name.startswith("eval/"):
        return "eval/" in strings and _written(name.removeprefix("eval/"), strings)
    if not PLACEHOLDER.search(name):
        return name in strings
    pieces = [piece for piece in PLACEHOLDER.split(name) if piece]
    return all(any(piece in string for string in strings) for piece in pieces)


def test_the_metrics_page_names_only_metrics_the_code_writes():
    names = _metric_names()
    assert len(names) > 60 and "loss" in names and "eval/pass@<k>" in names
    strings = _code_strings()
    unknown = [name for name in names if not _written(name, strings)]
    assert not unknown, f"docs/reference/metrics.md names metrics no code writes (renamed?): {unknown}"
    assert not _written("reward_meen", strings) and not _written("eval/no_such_figure", strings)


def _logged_keys(path) -> set[str]:
    """The record keys a module writes: `record["x"] = ...`, dict literals assigned to `record`, and the
    keywords of `record.update(...)`; `rollout/` and `targets/` sums excluded (they are divided, not logged)."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            if getattr(node.value, "id", None) == "record" and isinstance(node.slice, ast.Constant):
                keys.add(node.slice.value)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            if [getattr(target, "id", None) for target in node.targets] == ["record"]:
                keys |= {key.value for key in node.value.keys if isinstance(key, ast.Constant)}
        elif _is_record_update(node):
            keys |= {keyword.arg for keyword in node.keywords if keyword.arg}
    return {key for key in keys if isinstance(key, str) and "/" not in key}


def test_every_figure_of_the_step_metrics_and_the_loops_is_documented():
    names = set(_metric_names())
    for module in ("astrai/training/step_metrics.py", "astrai/training/loops.py"):
        keys = _logged_keys(REPO / module)
        assert keys, f"the scan found no record key in {module}"
        missing = sorted(keys - names)
        assert not missing, f"{module} logs metrics docs/reference/metrics.md does not list: {missing}"
    assert {"response_len_mean", "explained_variance", "tokens_per_s", "rollout_s"} <= _logged_keys(
        REPO / "astrai/training/step_metrics.py"
    ) | _logged_keys(REPO / "astrai/training/loops.py")
