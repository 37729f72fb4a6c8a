"""One writer per output_dir, and ranks that die with their launcher, with real `deepspeed` launches of 2 ranks.

A long job A runs; a second launch B on the same output_dir fails at once on every rank, naming A's
host, pid and start time, and writes nothing into it; SIGKILL of A's `deepspeed` launcher (only that
process: its per-node launcher and ranks are left to themselves, as a `kill -9` of the launcher leaves
them) stops every rank of A within a bound and nothing is published afterwards; then a new launch C
takes the lock and finishes, resuming A's newest checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from astrai.checkpoint import list_published
from astrai.run_lock import RECORD_NAME
from tests.conftest import REPO, child_env, deepspeed_launcher, free_port, launch_ranks

pytestmark = pytest.mark.slow

TINY = [
    "train.micro_batch_size=4",
    "model.init.hidden_size=32",
    "model.init.intermediate_size=64",
    "model.init.num_hidden_layers=2",
    "runtime.progress_bar=false",
    "runtime.tensorboard=false",
    "export.on_finish=false",
    "checkpoint.keep_last=null",
]
START_BOUND_S = 420  # imports and the first checkpoint on a busy 2-core machine
GONE_BOUND_S = 60  # the ranks poll their launchers every second; generous for a loaded machine


def train_arguments(output_dir: Path, *settings: str) -> list[str]:
    arguments = ["astrai/train.py", "--config", "configs/quickstart.yaml", "--set", f"output_dir={output_dir}"]
    for assignment in [*TINY, *settings]:
        arguments += ["--set", assignment]
    return arguments


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for its reaper, but runs no code)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, bound_s: float, what: str, process: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"{what}: the launch ended first ({process.returncode}): {log.read_text()[-3000:] if log else ''}"
            )
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {bound_s} s")


def rank_pids(output_dir: Path) -> dict[int, int] | None:
    """{rank: pid} from the reports of ranks that joined the process group, once both did."""
    reports = {}
    for rank in (0, 1):
        try:
            facts = json.loads((output_dir / "ranks" / f"rank_{rank}.json").read_text())
        except (OSError, ValueError):
            return None
        if not facts["joined_process_group"]:
            return None
        reports[rank] = facts["pid"]
    return reports


def test_one_writer_per_output_dir_and_ranks_die_with_their_launcher(tmp_path):
    output_dir = tmp_path / "out"
    command = deepspeed_launcher() + [
        "--num_gpus=2",
        "--master_port",
        str(free_port()),
        *train_arguments(output_dir, "train.max_steps=100000", "checkpoint.every_steps=2"),
    ]
    log = (tmp_path / "first.log").open("w")  # a file, not a pipe: a long run's log would fill a pipe nobody reads
    first = subprocess.Popen(
        command, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        pids = wait_for(lambda: rank_pids(output_dir), START_BOUND_S, "A's ranks joined", first, tmp_path / "first.log")
        wait_for(
            lambda: list_published(output_dir / "checkpoints"),
            START_BOUND_S,
            "A's first checkpoint",
            first,
            tmp_path / "first.log",
        )
        record = json.loads((output_dir / RECORD_NAME).read_text())
        assert (record["host"], record["pid"]) == (socket.gethostname(), pids[0])

        # B: refused at once on every rank, naming A; nothing of A's output_dir rewritten.
        job_yaml = (output_dir / "job.yaml").stat().st_mtime_ns
        second = launch_ranks(train_arguments(output_dir, "train.max_steps=100000"), ranks=2, timeout=300)
        said = second.stdout + second.stderr
        assert second.returncode == 1, said[-4000:]
        host = socket.gethostname()
        named = f"output_dir {output_dir} is in use by the job of host {host} pid {pids[0]} "
        named += f"(started {record['started']}"
        for rank in (0, 1):  # every rank says it
            assert any(f"[rank{rank}]" in line and named in line for line in said.splitlines()), said[-4000:]
        assert (output_dir / "job.yaml").stat().st_mtime_ns == job_yaml
        assert all(running(pid) for pid in pids.values()), "B must not disturb A"
        assert json.loads((output_dir / RECORD_NAME).read_text()) == record
        current = {rank: json.loads((output_dir / "ranks" / f"rank_{rank}.json").read_text())["pid"] for rank in (0, 1)}
        assert current == pids  # B's ranks wrote no report over A's

        # SIGKILL of A's `deepspeed` launcher alone: every rank of A stops, publishing nothing more.
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        wait_for(
            lambda: not any(running(pid) for pid in pids.values()), GONE_BOUND_S, "A's ranks gone after their launcher"
        )
        published = list_published(output_dir / "checkpoints")
        time.sleep(3)
        assert list_published(output_dir / "checkpoints") == published
        last_step = published[-1][0]
        assert last_step < 100000
        assert not (output_dir / RECORD_NAME).exists()  # the orphaned rank 0 released its lock on the way out
        said = (tmp_path / "first.log").read_text()
        assert said.count(f"the launcher that started this rank is gone (deepspeed, pid {first.pid})") == 2, said[
            -3000:
        ]
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    # C: the output_dir is free again; it resumes A's newest checkpoint and finishes.
    third = launch_ranks(train_arguments(output_dir, f"train.max_steps={last_step + 1}"), ranks=2, timeout=420)
    assert third.returncode == 0, (third.stdout + third.stderr)[-4000:]
    assert list_published(output_dir / "checkpoints")[-1][0] == last_step + 1
    assert not (output_dir / RECORD_NAME).exists()  # released at exit
