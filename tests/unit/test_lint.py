"""The tree is ruff-clean: `ruff check` (rules in pyproject.toml) and `ruff format`, over the folders that
CONTRIBUTING.md names. Ruff comes with the dev extras (as pytest does); a failure lists the offending lines."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.conftest import REPO

FOLDERS = ["astrai", "tests", "benchmarks", "scripts"]


def ruff(*arguments: str) -> subprocess.CompletedProcess:
    assert importlib.util.find_spec("ruff"), "ruff is not installed: pip install -e '.[dev]'"
    command = [sys.executable, "-m", "ruff", *arguments, "--no-cache", *FOLDERS]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_check_finds_nothing():
    result = ruff("check", "--output-format", "concise")
    assert result.returncode == 0, f"ruff check (then: ruff check --fix FILES):\n{result.stdout}{result.stderr}"


def test_ruff_format_changes_nothing():
    result = ruff("format", "--diff")  # the diff names each file and line that the formatter would change
    assert result.returncode == 0, f"ruff format would change (run: ruff format FILES):\n{result.stdout}{result.stderr}"
