"""The output_dir lock (astrai/launch/output_lock.py) between real processes on the real filesystem: a live holder is
refused and named, a SIGKILLed one is taken over, another host's record counts while its heartbeat is
fresh, release leaves the lock file; `python -m astrai launch` refuses an output_dir in use."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from astrai.launch import output_lock as run_lock
from astrai.launch.output_lock import (
    LOCK_NAME,
    RECORD_NAME,
    OutputDirLockedError,
    RunLock,
    agree_on_lock,
    live_holder,
    lock_for_this_rank,
)
from tests.conftest import REPO, child_env, python

HOLD = (
    "import sys, time; from astrai.launch.output_lock import RunLock; RunLock(sys.argv[1], sys.argv[2]).acquire(); "
    "print('held', flush=True); time.sleep(600)"
)


class Holder:
    """Another process holding the lock on `output_dir` until stopped."""

    def __init__(self, output_dir: Path, config: str = "configs/quickstart.yaml"):
        self.process = subprocess.Popen(
            [python(), "-c", HOLD, str(output_dir), config],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        ready, _, _ = select.select([self.process.stdout], [], [], 120)
        assert ready and self.process.stdout.readline().strip() == "held", "the holder did not take the lock"

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(60)


@pytest.fixture
def holder(tmp_path):
    started = Holder(tmp_path / "out")
    yield started
    if started.process.poll() is None:
        started.kill()


def test_a_live_holder_is_refused_and_named(tmp_path, holder):
    record = json.loads((tmp_path / "out" / RECORD_NAME).read_text())
    assert record["host"] == socket.gethostname() and record["pid"] == holder.process.pid
    assert record["config"] == str(REPO / "configs" / "quickstart.yaml")
    with pytest.raises(OutputDirLockedError) as refused:
        RunLock(tmp_path / "out", "mine.yaml").acquire()
    message = str(refused.value)
    assert (
        f"output_dir {tmp_path / 'out'} is in use by the job of host {socket.gethostname()} pid {holder.process.pid} "
        f"(started {record['started']}" in message
    )
    assert "job file " + record["config"] in message
    assert json.loads((tmp_path / "out" / RECORD_NAME).read_text()) == record  # the refused one wrote nothing
    assert live_holder(tmp_path / "out") is not None


def test_a_sigkilled_holder_is_taken_over_and_logged(tmp_path, holder, caplog):
    dead_pid = holder.process.pid
    holder.kill()
    assert (tmp_path / "out" / RECORD_NAME).is_file()  # SIGKILL left its record: the flock went with the process
    assert live_holder(tmp_path / "out") is None
    with caplog.at_level(logging.WARNING, logger="astrai.lock"):
        lock = RunLock(tmp_path / "out", "mine.yaml").acquire()
    try:
        assert f"taking over the lock of a job that is gone: host {socket.gethostname()} pid {dead_pid}" in caplog.text
        assert json.loads(lock.record_path.read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not lock.record_path.exists() and (tmp_path / "out" / LOCK_NAME).is_file()  # the lock file stays
    RunLock(tmp_path / "out").acquire().release()  # free again


def write_record(output_dir: Path, **fields) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "host": "node-b",
        "pid": 4242,
        "process_start": "1",
        "started": "2026-01-01T00:00:00+0000",
        "config": "/jobs/a.yaml",
        "rendezvous": "node-b:29500",
        **fields,
    }
    path = output_dir / RECORD_NAME
    path.write_text(json.dumps(record))
    return path


def test_another_hosts_record_counts_while_its_heartbeat_is_fresh(tmp_path, caplog):
    """Storage whose flock is not shared between hosts: the flock is free here, the record decides."""
    path = write_record(tmp_path / "out")
    with pytest.raises(
        OutputDirLockedError,
        match=r"in use by the job of host node-b pid 4242 \(started 2026-01-01T00:00:00\+0000, job file /jobs/a.yaml\)"
        r".*if that job is gone",
    ):
        RunLock(tmp_path / "out").acquire()
    assert live_holder(tmp_path / "out").host == "node-b"
    stale = time.time() - run_lock.STALE_AFTER_S - 5
    os.utime(path, (stale, stale))
    with caplog.at_level(logging.WARNING, logger="astrai.lock"):
        lock = RunLock(tmp_path / "out").acquire()
    lock.release()
    assert "taking over the lock of a job that is gone: host node-b pid 4242" in caplog.text


def test_this_hosts_record_of_a_reused_pid_is_stale(tmp_path):
    write_record(
        tmp_path / "out", host=socket.gethostname(), pid=os.getpid(), process_start="1"
    )  # our pid, another start time
    assert live_holder(tmp_path / "out") is None


def test_ranks_other_than_0_lock_nothing_and_see_only_another_launchs_holder(tmp_path, monkeypatch, holder):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    lock, refusal = lock_for_this_rank(tmp_path / "out", "job.yaml")
    assert lock.descriptor is None and f"pid {holder.process.pid}" in refusal
    write_record(
        tmp_path / "mine",
        host=socket.gethostname(),
        pid=holder.process.pid,
        rendezvous="127.0.0.1:1234",
        process_start=None,
    )
    assert lock_for_this_rank(tmp_path / "mine", "job.yaml")[1] is None  # our own launch's rank 0 holds it
    with pytest.raises(OutputDirLockedError, match="is in use"):
        agree_on_lock(None, lambda mine: ["output_dir x is in use by the job of ...", mine])  # rank 0's verdict rules


def test_launch_refuses_an_output_dir_in_use(tmp_path, holder):
    job = tmp_path / "job.yaml"
    body = (
        (REPO / "configs" / "quickstart.yaml")
        .read_text()
        .replace("output_dir: runs/quickstart", f"output_dir: {tmp_path / 'out'}")
    )
    job.write_text(body + "\ninfra:\n  launcher: no_ssh\n  nodes: [{host: localhost, slots: 1}]\n")
    finished = subprocess.run(
        [python(), "-m", "astrai", "launch", "--config", str(job), "--dry-run", "--node-rank", "0"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 1, finished.stderr
    assert (
        f"astrai launch: output_dir {tmp_path / 'out'} is in use by the job of host {socket.gethostname()} "
        f"pid {holder.process.pid}" in finished.stderr
    )
    assert not (tmp_path / "out" / "launch").exists()


def test_an_output_dir_that_cannot_be_locked_is_a_refusal_for_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "file").write_text("not a folder")
    lock, refusal = lock_for_this_rank(tmp_path / "file" / "out", "job.yaml")
    output_dir = tmp_path / "file" / "out"
    assert lock.descriptor is None and refusal.startswith(
        f"{output_dir}: ENOTDIR: Not a directory (output_dir: {output_dir};"
    )


def test_a_holder_whose_record_is_not_written_yet_is_not_confused_with_the_dead_job_before_it(tmp_path):
    write_record(tmp_path / "out", host=socket.gethostname(), pid=2**22 + 7)  # a dead job's leftover record
    other = os.open(tmp_path / "out" / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        import fcntl

        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a holder between its flock and its record
        with pytest.raises(
            OutputDirLockedError, match=r"is in use by another job \(it holds .*; no record of it yet\)"
        ):
            RunLock(tmp_path / "out").acquire()
    finally:
        os.close(other)
