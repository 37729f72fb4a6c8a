"""CheckpointPublisher across 2 real gloo ranks (separate processes, rendezvous on 127.0.0.1).

One launch checks, in order: cleanup_stale; a normal publish; a failure injected in rank 1's write callback;
ranks disagreeing on the step; storage that is not shared; ranks listing different files in the staging
directory; a publish again on the same group.
Two more launches have rank 1 die, or hang, mid-save and check rank 0 fails within the bounded
timeout with the stalled phase named, and publishes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.checkpoint import find_latest, read_manifest, verify_checkpoint
from astrai.checkpoint.layout import list_hidden, list_published
from tests.conftest import free_port

REPOSITORY = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("checkpoint_rank_worker.py")
WORLD_SIZE = 2


def launch(scenario: str, root: Path, timeout_s: float = 120) -> tuple[list[dict | None], list[int], str]:
    """Run the worker on WORLD_SIZE ranks: each rank's results (None if it wrote none), exit codes, output."""
    results_dir = root / "results"
    results_dir.mkdir(parents=True)
    port = free_port()
    ranks = []
    for rank in range(WORLD_SIZE):
        environment = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(WORLD_SIZE),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
            OMP_NUM_THREADS="1",
        )
        ranks.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(root), str(results_dir)],
                cwd=REPOSITORY,
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=timeout_s)[0])
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    results = []
    for rank in range(WORLD_SIZE):
        path = results_dir / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    logs = "\n".join(f"--- rank {rank} ---\n{output}" for rank, output in enumerate(outputs))
    return results, [process.returncode for process in ranks], logs


@pytest.mark.slow
def test_two_ranks_publish_and_fail_together(tmp_path):
    results, exit_codes, logs = launch("suite", tmp_path)
    assert exit_codes == [0, 0] and None not in results, logs
    checkpoints = tmp_path / "checkpoints"
    stale = str(checkpoints / ".step_00000005.staging-0dead")
    assert [result["cleanup_removed"] for result in results] == [[stale], [stale]]

    # (a) a normal publish: one checkpoint holding both ranks' files, the same report on both ranks.
    normal = [result["normal"] for result in results]
    assert all(outcome["ok"] for outcome in normal), normal
    assert normal[0]["path"] == normal[1]["path"] == str(checkpoints / "step_00000010")
    manifest = read_manifest(checkpoints / "step_00000010")
    assert manifest.world_size == 2 and manifest.parts == ("policy",)
    assert sorted(manifest.files) == ["job.yaml", "policy/rank_0.bin", "policy/rank_1.bin", "trainer_state.json"]

    # (b) rank 1's write callback raises: both ranks fail naming rank 1; only rank 1 chains its own error.
    failed = [result["write_fails"] for result in results]
    for outcome in failed:
        assert not outcome["ok"] and outcome["type"] == "CheckpointError"
        assert "failed in phase 'write' on rank 1: RuntimeError: injected failure on rank 1" in outcome["error"]
    assert [outcome["cause"] for outcome in failed] == [None, "RuntimeError"]

    # (c) ranks disagree on the step: aborted before anything is written.
    for outcome in (result["steps_disagree"] for result in results):
        assert not outcome["ok"] and "rank 0 saves step 30, rank 1 saves step 31" in outcome["error"]

    # (e) rank 1 writes to a folder rank 0 cannot see: the shared-storage check names it.
    for outcome in (result["not_shared"] for result in results):
        assert not outcome["ok"] and "phase 'shared-storage' on rank 1" in outcome["error"]
        assert "checkpoint storage must be shared by all ranks" in outcome["error"] and "on host" in outcome["error"]

    # (f) rank 1 lists a file rank 0 does not: the listing gather aborts (after its retries), nothing is hashed.
    for outcome in (result["listings_differ"] for result in results):
        assert not outcome["ok"] and outcome["type"] == "CheckpointError", outcome
        assert (
            "checkpoint save step 60: rank 1 sees different files than rank 0 in the staging directory"
            in outcome["error"]
        )
        assert (
            "missing [], extra ['policy/node_local']" in outcome["error"]
            and "nothing was published" in outcome["error"]
        )

    # (g) each rank's file hashed while written: fsynced and size-checked by the rank that wrote it, not read
    # back; the other files shared out as before. Two ranks reporting one file abort the save.
    streamed = [result["streamed"] for result in results]
    assert all(outcome["ok"] and outcome["hashed_while_written"] == 2 for outcome in streamed), streamed
    shares = [result["streamed_shares"] for result in results]
    assert [share[0]["known"] for share in shares] == [["policy/streamed_0.bin"], ["policy/streamed_1.bin"]]
    read = sorted(path for share in shares for path in share[0]["read"])
    assert read == ["job.yaml", "policy/rank_0.bin", "policy/rank_1.bin", "trainer_state.json"]
    assert all(len(share[0]["read"]) == 2 for share in shares)
    for outcome in (result["claimed_twice"] for result in results):
        assert not outcome["ok"] and "ranks 0 and 1 both report writing 'policy/streamed_0.bin'" in outcome["error"]

    # The group survived the failures; failed saves left nothing behind.
    assert all(result["after_failures"]["ok"] for result in results)
    assert [path.name for _, path in list_published(checkpoints)] == ["step_00000010", "step_00000050", "step_00000070"]
    assert list_hidden(checkpoints) == [] and not (tmp_path / "node-local-disk" / "checkpoints").exists()
    for _, path in list_published(checkpoints):
        verify_checkpoint(path)


@pytest.mark.slow
def test_a_rank_dying_mid_save_fails_rank_zero_within_the_timeout(tmp_path):
    results, exit_codes, logs = launch("rank_dies", tmp_path)
    assert exit_codes == [0, 17] and results[1] is None, logs
    assert results[0]["normal"]["ok"]
    outcome = results[0]["peer_died"]
    assert not outcome["ok"], logs
    assert "checkpoint save step 20: phase 'write' did not complete within 5 s; a rank died or hung" in outcome["error"]
    assert outcome["seconds"] < 20
    checkpoints = tmp_path / "checkpoints"
    assert [path.name for _, path in list_published(checkpoints)] == ["step_00000010"]
    assert list_hidden(checkpoints) == []
    assert find_latest(checkpoints, verify=True) == checkpoints / "step_00000010"


@pytest.mark.slow
def test_a_rank_hanging_mid_save_fails_rank_zero_after_the_timeout(tmp_path):
    results, exit_codes, logs = launch("rank_hangs", tmp_path)
    assert exit_codes == [0, 18] and results[1] is None, logs
    outcome = results[0]["peer_hung"]
    assert not outcome["ok"], logs
    assert "checkpoint save step 10: phase 'write' did not complete within 4 s; a rank died or hung" in outcome["error"]
    assert "Ranks 1 failed to pass monitoredBarrier" in outcome["error"]  # gloo names the missing rank
    assert 3.5 < outcome["seconds"] < 20
    checkpoints = tmp_path / "checkpoints"
    assert list_published(checkpoints) == [] and list_hidden(checkpoints) == []
