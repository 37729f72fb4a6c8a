"""The docs site (mkdocs.yml) builds in strict mode, and the troubleshooting page quotes only messages the code
prints.

Strict mode fails the build on a link to a missing page or #anchor and on a page under docs/ that the
navigation leaves out (mkdocs.yml, `validation`). mkdocs and its theme come with the dev extra (and the `docs`
extra); the build takes about a second.

docs/guides/troubleshooting.md quotes each message in a blockquote line (`> ` then code spans, `…` between
the pieces where the message has values): every code span there must be a literal piece of a string in the
code under astrai/ (a plain string, or the fixed text of an f-string between its placeholders; implicitly
joined literals count as one), so a reworded message fails here until the page follows it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

DOCS = REPO / "docs"
TROUBLESHOOTING = DOCS / "guides" / "troubleshooting.md"
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
SHORTEST_PIECE = 10  # a shorter code span could match by chance
SHORTEST_MESSAGE = 25  # the quoted pieces of one message, together


def test_site_builds_in_strict_mode(tmp_path):
    assert importlib.util.find_spec("mkdocs"), "mkdocs is not installed: pip install -c constraints.txt -e '.[dev]'"
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about mkdocs 2.0
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    pages = sorted(path.relative_to(DOCS).with_suffix("") for path in DOCS.rglob("*.md"))
    expected = [site / "index.html" if page == Path("index") else site / page / "index.html" for page in pages]
    missing = [str(path.relative_to(site)) for path in expected if not path.is_file()]
    assert not missing, f"pages missing from the built site: {missing}"
    for page in ("get-started", "guides/config", "guides/troubleshooting", "benchmarks", "developer/architecture"):
        assert (site / page / "index.html").is_file(), page
    assert (site / "search" / "search_index.json").is_file()
    assert "Troubleshooting" in (site / "guides" / "troubleshooting" / "index.html").read_text()


def quoted_messages(text: str) -> list[list[str]]:
    """The code spans of each blockquote line of a page, one list per line that has any."""
    messages = []
    for line in text.splitlines():
        if line.startswith(">"):
            pieces = [span.strip() if span.strip() else span for _, span in CODE_SPAN.findall(line)]
            if pieces:
                messages.append(pieces)
    return messages


def code_strings(root: Path) -> list[str]:
    """Every string literal of the Python code under `root`, f-strings as their fixed pieces; docstrings and
    other bare string statements left out (they are not messages)."""
    strings = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        bare = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        strings.extend(
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in bare
        )
    return strings


def test_quoted_messages_parse():
    spans = quoted_messages("> `invalid job config:` … `unknown key`\n> `` give `x` or `y` ``\nnot `quoted`")
    assert spans == [["invalid job config:", "unknown key"], ["give `x` or `y`"]]


def test_troubleshooting_quotes_messages_the_code_prints():
    messages = quoted_messages(TROUBLESHOOTING.read_text(encoding="utf-8"))
    assert len(messages) >= 15, f"{len(messages)} quoted messages: the page should list the common errors"
    strings = code_strings(REPO / "astrai")
    short = [pieces for pieces in messages if sum(map(len, pieces)) < SHORTEST_MESSAGE]
    short += [[piece] for pieces in messages for piece in pieces if len(piece) < SHORTEST_PIECE]
    assert not short, f"quote a longer fixed piece of these messages: {short}"
    unknown = [piece for pieces in messages for piece in pieces if not any(piece in string for string in strings)]
    assert not unknown, (
        f"{TROUBLESHOOTING.relative_to(REPO)} quotes text that no string under astrai/ holds (reworded?): {unknown}"
    )
