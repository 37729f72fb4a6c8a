"""The command-line reference (`docs/reference/cli.md`) generated from the tools' argparse parsers.

python -m astrai cli-docs > docs/reference/cli.md

This module only renders: astrai/__main__.py, the one module that knows every tool (and the only one above
every tool's package, astrai/export/cli.py included: tests/unit/test_layering.py), hands it each tool's
one-line purpose and its parser (`build_parser()` of the tool's module), so a flag, a default or a help text
changed in a parser changes the page, and tests/unit/test_cli_docs.py fails until the page is regenerated.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable

HEADER = """# Command-line tools

Generated from the tools' argparse parsers by `python -m astrai cli-docs`; a test fails when this file and
the parsers disagree. Every tool runs as `python -m astrai <tool>`; `python -m astrai --help` lists them,
and a tool with flags prints its own help with `-h`. Training itself starts from `astrai/train.py` (one
GPU: `python astrai/train.py --config job.yaml`) or `python -m astrai launch` (every node of a hostfile).
"""

WIDTH = 10_000  # one usage line whatever the terminal (argparse wraps at $COLUMNS otherwise)


def _prose(text: str) -> str:
    """Help text as markdown: `<N>` kept as text (not an HTML tag) outside code spans, `(docs/guides/x.md)` a link
    that resolves from docs/reference/ (and on the site)."""
    pieces = re.split(r"(`[^`]*`)", text)
    text = "".join(
        piece if piece.startswith("`") else piece.replace("<", "&lt;").replace(">", "&gt;") for piece in pieces
    )
    return re.sub(r"\(docs/([\w/.-]+\.md)\)", lambda match: f"([{match[1]}](../{match[1]}))", text)


def _cell(text: str) -> str:
    return _prose(text).replace("|", "\\|").replace("\n", " ")


def _flag(action: argparse.Action) -> str:
    """The flag's names and what it takes: `--dtype` {bf16,fp16,fp32}, `--set` KEY.PATH=VALUE (repeatable)."""
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.nargs == 0:  # store_true and friends take no value
        return names
    if action.choices is not None:
        takes = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    elif action.option_strings:
        takes = action.metavar or action.dest.upper()
    else:
        takes = ""
    repeatable = " (repeatable)" if isinstance(action, argparse._AppendAction) else ""
    return f"{names} {_cell(takes)}".rstrip() + repeatable


def _default(action: argparse.Action) -> str:
    if action.required or not action.option_strings:
        return "**required**"
    if action.nargs == 0:
        return f"`{str(bool(action.default)).lower()}`"
    if action.default is None or action.default == []:
        return "(none)"
    if action.default == "":
        return '`""`'
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "default": action.default}
    return _cell(text)


def _usage(tool: str, parser: argparse.ArgumentParser | None) -> str:
    if parser is None:
        return f"python -m astrai {tool}"
    formatter = argparse.HelpFormatter(f"python -m astrai {tool}", width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def render_tool(tool: str, purpose: str, parser: argparse.ArgumentParser | None) -> str:
    """One tool's section: purpose, the parser's description, the usage line and the table of its flags."""
    lines = [f"## `{tool}`", "", _prose(purpose[:1].upper() + purpose[1:]) + ".", ""]
    description = (parser.description or "").strip() if parser is not None else ""
    if description:
        lines += [_prose(description), ""]
    lines += ["```text", _usage(tool, parser), "```", ""]
    actions = [
        action
        for action in (parser._actions if parser is not None else [])
        if action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
    ]
    if not actions:
        return "\n".join(lines + ["Takes no arguments.", ""])
    lines += ["| Argument | Default | Meaning |", "|---|---|---|"]
    lines += [f"| {_flag(action)} | {_default(action)} | {_help(action)} |" for action in actions]
    return "\n".join(lines + [""])


def render_cli_reference(tools: Iterable[tuple[str, str, argparse.ArgumentParser | None]]) -> str:
    """The whole page from (tool, one-line purpose, parser or None for a tool that takes no arguments)."""
    return "\n".join([HEADER, *(render_tool(tool, purpose, parser) for tool, purpose, parser in tools)])
