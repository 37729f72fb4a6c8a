"""Shared fixtures: paths of the repo and small job files written per test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo process group in this process, for one test module's in-process DeepSpeed engines.

    Torn down after the module with DeepSpeed's cached clone of the world group, so that a later module
    can create its own; the launcher variables it sets (RANK, MASTER_PORT, ...) must not leak into later
    tests' subprocess launches either."""
    from astrai.engine import setup_distributed, shutdown_distributed

    saved = dict(os.environ)
    yield setup_distributed(60)
    shutdown_distributed()  # also drops DeepSpeed's clone of the world group, else the next engine uses a destroyed group
    os.environ.clear()
    os.environ.update(saved)


def child_env(**extra: str) -> dict[str, str]:
    """Environment for launched ranks: the repo importable, no hub, quiet progress output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def python() -> str:
    return sys.executable


def deepspeed_launcher() -> list[str]:
    """The real `deepspeed` launcher of this environment."""
    return [str(Path(sys.executable).with_name("deepspeed"))]
