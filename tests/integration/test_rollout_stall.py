"""A hung rank fails a ZeRO-3 rollout weight sync within runtime.dist_timeout_s, with the operation and rank named.

DeepSpeed runs ZeRO collectives on its own clone of the world group, which torch would give a 30-minute
default timeout; AstrAI makes that clone with the job's timeout (4 s here). Two plain gloo processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env, free_port

pytestmark = pytest.mark.slow


def test_a_stalled_rank_fails_the_rollout_sync_in_bounded_time(tmp_path):
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("rollout_stall_worker.py")), str(tmp_path)],
            cwd=REPO,
            env=child_env(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        logs = [process.communicate(timeout=240)[0] for process in processes[:1]]
    finally:
        for process in processes:
            process.kill()
    assert (tmp_path / "rank0.json").exists(), logs[0][-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    assert rank1["synced_parameters"] > 0  # the first, joint sync filled the whole copy
    assert rank0["error"] is not None, rank0
    assert rank0["error"].startswith(
        "rollout weight sync: the ZeRO-3 all-gather of model.embed_tokens.weight did not complete on rank 0"
    )
    assert 3.5 < rank0["seconds"] < 30, rank0  # the job's 4 s, not torch's 30 minutes
