"""Real crashes: a publishing process SIGKILLed at random moments, and a file-size limit (RLIMIT_FSIZE).

A kill -9 keeps the page cache, so these tests check atomicity and cleanup, not durability
(fsync order is checked with the recording wrapper in test_checkpoint_publish.py).
"""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astrai.checkpoint import CheckpointPublisher, cleanup_stale, find_latest, verify_checkpoint
from astrai.checkpoint.layout import list_hidden, list_published, parse_step_dir_name

REPOSITORY = Path(__file__).resolve().parents[3]

# Publishes forever: a few MB of random shards per checkpoint, sometimes republishing the same
# step, keep_last=3 so that retention deletions are killed too.
PUBLISH_FOREVER = """
import json, random, sys
from pathlib import Path
from astrai.checkpoint import CheckpointPublisher, find_latest, parse_step_dir_name

root, seed = Path(sys.argv[1]), int(sys.argv[2])
rng = random.Random(seed)
latest = find_latest(root)
step = parse_step_dir_name(latest.name) if latest else 0
publisher = CheckpointPublisher(root, parts=["policy"], keep_last=3, hash_threads=2)
print("ready", flush=True)
while True:
    step += 1 if rng.random() < 0.75 else 0

    def write(staging):
        (staging / "policy").mkdir()
        for index in range(3):
            size = rng.randint(256 * 1024, 1024 * 1024)
            (staging / "policy" / f"shard_{index}.bin").write_bytes(rng.randbytes(size))
        (staging / "trainer_state.json").write_text(json.dumps({"step": step}))

    publisher.publish(step, write)
    print("published", step, flush=True)
"""

# Publishes one checkpoint bigger than the RLIMIT_FSIZE set by the parent; exits 3 on CheckpointError.
PUBLISH_TOO_BIG = """
import sys
from pathlib import Path
from astrai.checkpoint import CheckpointError, CheckpointPublisher

def write(staging):
    (staging / "policy").mkdir()
    (staging / "policy" / "huge.bin").write_bytes(b"x" * (4 * 1024 * 1024))

try:
    CheckpointPublisher(Path(sys.argv[1]), parts=["policy"]).publish(2, write)
except CheckpointError as error:
    print(error, flush=True)
    sys.exit(3)
"""


def small_payload(staging: Path) -> None:
    (staging / "policy").mkdir()
    (staging / "policy" / "weights.bin").write_bytes(os.urandom(64 * 1024))


def check_directory(root: Path) -> None:
    """Every published checkpoint verifies and find_latest never returns a hidden directory."""
    for _, checkpoint in list_published(root):
        verify_checkpoint(checkpoint)
    latest = find_latest(root, verify=True)
    published = list_published(root)
    assert latest == (published[-1][1] if published else None)
    assert latest is None or not latest.name.startswith(".")


@pytest.mark.slow
def test_sigkill_at_random_moments_never_breaks_the_newest_checkpoint(tmp_path):
    rng = random.Random(20240607)
    interrupted_saves = 0
    for iteration in range(14):
        child = subprocess.Popen(
            [sys.executable, "-c", PUBLISH_FOREVER, str(tmp_path), str(iteration)],
            cwd=REPOSITORY,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.05, 0.8))
        child.send_signal(signal.SIGKILL)
        output, errors = child.communicate(timeout=30)
        assert child.returncode == -signal.SIGKILL, errors

        interrupted_saves += bool(list_hidden(tmp_path))
        check_directory(tmp_path)
        cleanup_stale(tmp_path)
        assert list_hidden(tmp_path) == []
        check_directory(tmp_path)
        latest = find_latest(tmp_path, verify=True)
        next_step = (parse_step_dir_name(latest.name) if latest else 0) + 1
        report = CheckpointPublisher(tmp_path, parts=["policy"], keep_last=3).publish(next_step, small_payload)
        assert find_latest(tmp_path, verify=True) == report.path
    assert interrupted_saves >= 3  # the kills did land inside saves, not only between them


@pytest.mark.slow
def test_file_size_limit_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    previous = CheckpointPublisher(tmp_path, parts=["policy"]).publish(1, small_payload).path

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024 * 1024, 1024 * 1024))

    child = subprocess.run(
        [sys.executable, "-c", PUBLISH_TOO_BIG, str(tmp_path)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit_file_size,
    )
    assert child.returncode == 3, child.stderr
    assert "checkpoint save step 2 failed in phase 'write' on rank 0" in child.stdout
    assert "File too large" in child.stdout and "file size limit" in child.stdout
    assert [path for _, path in list_published(tmp_path)] == [previous] and list_hidden(tmp_path) == []
    verify_checkpoint(previous)
