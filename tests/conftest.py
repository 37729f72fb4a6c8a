"""Shared fixtures: paths of the repo and small job files written per test."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
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
    # also drops DeepSpeed's clone of the world group, else the next engine uses a destroyed group
    shutdown_distributed()
    os.environ.clear()
    os.environ.update(saved)


RENDEZVOUS_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def child_env(**extra: str) -> dict[str, str]:
    """Environment for launched ranks: the repo importable, no hub, quiet progress output."""
    # Never this process's rendezvous: an in-process test that set RANK/MASTER_PORT would send the child there.
    env = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


NETWORK_SPY = REPO / "tests" / "integration" / "network_spy"


def user_env(network_log: Path) -> dict[str, str]:
    """A launch environment as a user's shell has it (no HF_*_OFFLINE set by us), with the network spy
    (tests/integration/network_spy) loaded by every process: lookups and connections off this machine
    are refused and written to `network_log`."""
    env = child_env(ASTRAI_NETWORK_LOG=str(network_log))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_UPDATE_DOWNLOAD_COUNTS"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(NETWORK_SPY), env["PYTHONPATH"]])
    return env


def python() -> str:
    return sys.executable


def deepspeed_launcher() -> list[str]:
    """The real `deepspeed` launcher of this environment."""
    return [str(Path(sys.executable).with_name("deepspeed"))]


def run_bounded(command: list[str], timeout: float, **options) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)` in a session of its own, so that a
    timeout kills the whole tree (launcher -> launch.py -> ranks) and fails the test with the output
    so far. A plain `subprocess.run` timeout kills only the launcher: its ranks live on, holding their
    port and memory, and hang the launches that come after them."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **options
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"{' '.join(map(str, command[:4]))} ... ran past {timeout} s and was "
            f"killed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
        ) from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def launch_ranks(
    arguments: list[str], ranks: int, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The real `deepspeed --num_gpus ranks --master_port <free> ARGUMENTS` from the repo root, bounded.

    Every launch gets a free port of its own (DeepSpeed's default 29500 is shared by every launch that
    forgets one, so one leftover rank blocks them all), and must leave no shared-memory segment behind
    for it in /dev/shm (see astrai.engine.distributed.skip_shared_memory_allreduce). `env`: the launch's
    whole environment (default `child_env()`)."""
    port = free_port()
    command = deepspeed_launcher() + [f"--num_gpus={ranks}", "--master_port", str(port), *map(str, arguments)]
    finished = run_bounded(command, timeout, cwd=REPO, env=child_env() if env is None else env)
    leaked = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
    assert not leaked, f"the launch left shared memory behind: {leaked}"
    return finished


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
