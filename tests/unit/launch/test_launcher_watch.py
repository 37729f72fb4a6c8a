"""Ranks die with their launcher (astrai/launch/launcher_watch.py), with real processes standing in for DeepSpeed's:
a `deepspeed` runner script starts a per-node launcher (its command line names deepspeed.launcher.launch)
that starts a rank. SIGKILL of either launcher stops the rank: the runner's through the watching thread,
the per-node launcher's through PR_SET_PDEATHSIG. A process without such a parent watches nothing.
(tests/integration/test_run_lock_ranks.py does the same with the real `deepspeed` and training ranks.)"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astrai.launch.launcher_watch import launcher_name, launchers_above, watch_launchers
from tests.conftest import REPO, child_env

RANK = """
import json, logging, os, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
from astrai.launch.launcher_watch import watch_launchers
watched = watch_launchers()
print(json.dumps({"pid": os.getpid(), "watched": [[item.pid, item.name] for item in watched]}), flush=True)
time.sleep(600)
"""
# Parent of the rank: started with "deepspeed.launcher.launch" on its command line, it waits for its child.
NODE_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.Popen([sys.executable, '-c', sys.argv[2]]).wait())"
# The runner: a script named `deepspeed`, starting the node launcher, passing the rank's output through.
RUNNER = (
    "import subprocess, sys; "
    "sys.exit(subprocess.Popen([sys.executable, '-c', sys.argv[1], 'deepspeed.launcher.launch', sys.argv[2]]).wait())"
)
GONE_BOUND_S = 30


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def chain(tmp_path):
    """runner (`deepspeed`) -> node launcher -> rank; yields (runner process, the rank's first line)."""
    runner = tmp_path / "deepspeed"
    runner.write_text(RUNNER)
    process = subprocess.Popen(
        [sys.executable, str(runner), NODE_LAUNCHER, RANK],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready, _, _ = select.select([process.stdout], [], [], 120)
    assert ready, "the rank did not start"
    yield process, json.loads(process.stdout.readline())
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + GONE_BOUND_S
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(pid), f"the rank {pid} still runs {GONE_BOUND_S} s after its launcher died"


def test_the_rank_watches_both_launchers(chain):
    runner, rank = chain
    assert [name for _, name in rank["watched"]] == ["deepspeed.launcher.launch", "deepspeed"]
    assert rank["watched"][1][0] == runner.pid


def test_a_sigkilled_runner_stops_the_rank_through_the_watching_thread(chain):
    runner, rank = chain
    node_launcher = rank["watched"][0][0]
    os.kill(runner.pid, signal.SIGKILL)  # and not reaped (no wait) until the rank is gone: a zombie is no launcher
    wait_gone(rank["pid"])
    wait_gone(node_launcher)  # it saw its rank fail and ended too
    assert f"the launcher that started this rank is gone (deepspeed, pid {runner.pid})" in runner.stderr.read()


def test_a_sigkilled_node_launcher_stops_the_rank_through_the_kernel(chain):
    runner, rank = chain
    os.kill(rank["watched"][0][0], signal.SIGKILL)
    wait_gone(rank["pid"])
    runner.wait(30)  # the runner saw its node launcher die
    assert (
        "the launcher that started this rank is gone" not in runner.stderr.read()
    )  # SIGKILL came first, not the thread


def test_without_deepspeeds_launcher_nothing_is_watched():
    assert launchers_above() == [] and watch_launchers() == []  # pytest's parent is a shell, not a launcher


@pytest.mark.parametrize(
    ("arguments", "name"),
    [
        (
            ["/venv/bin/python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "astrai/train.py"],
            "deepspeed.launcher.launch",
        ),
        (["/venv/bin/python", "/venv/bin/deepspeed", "--num_gpus=2", "astrai/train.py"], "deepspeed"),
        (["/venv/bin/python", "-m", "astrai", "launch", "--config", "job.yaml"], "astrai launch"),
        (["/venv/bin/astrai", "launch", "--config", "job.yaml"], "astrai launch"),
        (["/venv/bin/python", "astrai/train.py", "--config", "job.yaml"], None),
        (["bash", "-c", "deepspeed astrai/train.py"], None),
        (["mpirun", "-n", "2", "python", "astrai/train.py"], None),
    ],
)
def test_launcher_names(arguments, name):
    assert launcher_name(arguments) == name


def test_leave_if_orphaned_exits_at_once_when_a_watched_launcher_is_gone():
    """The check the trainer makes just before a publishing rename: a launcher that exited (its pid gone,
    or reused by a process of another start time) ends this rank with ORPHAN_EXIT_CODE; a live one does not."""
    script = (
        "import subprocess, sys\n"
        "from astrai.launch.launcher_watch import Launcher, leave_if_orphaned, proc_stat, ORPHAN_EXIT_CODE\n"
        "live = Launcher(1, proc_stat(1)[1], 'deepspeed')\n"
        "leave_if_orphaned([live])\n"
        "child = subprocess.Popen([sys.executable, '-c', 'pass']); start = proc_stat(child.pid)[1]; child.wait()\n"
        "print('still here', flush=True)\n"
        "leave_if_orphaned([live, Launcher(child.pid, start, 'deepspeed')])\n"
        "print('not reached', flush=True)\n"
    )
    finished = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60
    )
    from astrai.launch.launcher_watch import ORPHAN_EXIT_CODE

    assert finished.returncode == ORPHAN_EXIT_CODE, finished.stderr
    assert finished.stdout.split() == ["still", "here"] and "launcher that started this rank is gone" in finished.stderr
