"""One writer per output_dir, and ranks that die with their launcher, with real `deepspeed` launches of 2 ranks.

A long job A runs; a second launch B on the same output_dir fails at once on every rank, naming A's
host, pid and start time, and writes nothing into it; SIGKILL of A's `deepspeed` launcher (only that
process: its per-node launcher and ranks are left to themselves, as a `kill -9` of the launcher leaves
them) stops every rank of A within a bound and nothing is published afterwards; a new long job C then
takes the lock, resumes A's newest checkpoint and publishes more, until its whole tree is SIGKILLed; its
record, left behind, is stale (dead pid): a last launch D takes the lock over, says so, and finishes.
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
from astrai.launch.output_lock import RECORD_NAME
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


def start_long_job(output_dir: Path, log: Path) -> subprocess.Popen:
    """A 2-rank `deepspeed` launch of a job that would run for hours, checkpointing every 2 steps, in its own
    session; its output goes to `log` (a file, not a pipe: a long run's log would fill a pipe nobody reads)."""
    arguments = train_arguments(output_dir, "train.max_steps=100000", "checkpoint.every_steps=2")
    command = deepspeed_launcher() + ["--num_gpus=2", "--master_port", str(free_port()), *arguments]
    with log.open("w") as handle:
        return subprocess.Popen(
            command, cwd=REPO, env=child_env(), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )


def kill_session(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(30)


def newest_step(output_dir: Path) -> int | None:
    published = list_published(output_dir / "checkpoints")
    return published[-1][0] if published else None


def test_one_writer_per_output_dir_and_ranks_die_with_their_launcher(tmp_path):
    output_dir, host = tmp_path / "out", socket.gethostname()
    first = start_long_job(output_dir, tmp_path / "first.log")
    try:
        pids = wait_for(lambda: rank_pids(output_dir), START_BOUND_S, "A's ranks joined", first, tmp_path / "first.log")
        wait_for(lambda: newest_step(output_dir), START_BOUND_S, "A's first checkpoint", first, tmp_path / "first.log")
        record = json.loads((output_dir / RECORD_NAME).read_text())
        assert (record["host"], record["pid"]) == (host, pids[0])

        # B: refused at once on every rank, naming A; nothing of A's output_dir rewritten.
        job_yaml = (output_dir / "job.yaml").stat().st_mtime_ns
        second = launch_ranks(train_arguments(output_dir, "train.max_steps=100000"), ranks=2, timeout=300)
        said = second.stdout + second.stderr
        assert second.returncode == 1, said[-4000:]
        named = f"output_dir {output_dir} is in use by the job of host {host} pid {pids[0]} "
        named += f"(started {record['started']}"
        for rank in (0, 1):  # every rank says it
            assert any(f"[rank{rank}]" in line and named in line for line in said.splitlines()), said[-4000:]
        assert (output_dir / "job.yaml").stat().st_mtime_ns == job_yaml
        assert all(running(pid) for pid in pids.values()), "B must not disturb A"
        assert json.loads((output_dir / RECORD_NAME).read_text()) == record
        assert rank_pids(output_dir) == pids  # B's ranks wrote no report over A's

        # SIGKILL of A's `deepspeed` launcher alone: every rank of A stops, publishing nothing more.
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        wait_for(lambda: not any(map(running, pids.values())), GONE_BOUND_S, "A's ranks gone after their launcher")
        published = list_published(output_dir / "checkpoints")
        time.sleep(3)
        assert list_published(output_dir / "checkpoints") == published
        last_step = published[-1][0]
        assert last_step < 100000
        assert not (output_dir / RECORD_NAME).exists()  # the orphaned rank 0 released its lock on the way out
        said = (tmp_path / "first.log").read_text()
        gone_line = f"the launcher that started this rank is gone (deepspeed, pid {first.pid})"
        # The first rank to notice leaves; the other notices too, or fails its next collective with that rank gone.
        assert gone_line in said, said[-3000:]
    finally:
        kill_session(first)

    # C takes the output_dir, resumes A's newest checkpoint and publishes more; then its whole tree is SIGKILLed.
    third = start_long_job(output_dir, tmp_path / "third.log")
    try:

        def joined_anew():
            found = rank_pids(output_dir)
            return found if found and not set(found.values()) & set(pids.values()) else None

        new_pids = wait_for(joined_anew, START_BOUND_S, "C's ranks joined", third, tmp_path / "third.log")
        later = lambda: (newest_step(output_dir) or 0) > last_step  # noqa: E731
        wait_for(later, START_BOUND_S, "C's first checkpoint", third, tmp_path / "third.log")
    finally:
        kill_session(third)
    assert json.loads((output_dir / RECORD_NAME).read_text())["pid"] == new_pids[0]  # left behind by SIGKILL

    # D: C's record is stale (its pid is dead): taken over, logged; D finishes one step later.
    target = newest_step(output_dir) + 1
    fourth = launch_ranks(train_arguments(output_dir, f"train.max_steps={target}"), ranks=2, timeout=420)
    said = fourth.stdout + fourth.stderr
    assert fourth.returncode == 0, said[-4000:]
    assert f"taking over the lock of a job that is gone: host {host} pid {new_pids[0]}" in said
    assert newest_step(output_dir) == target
    assert not (output_dir / RECORD_NAME).exists()  # released at exit
