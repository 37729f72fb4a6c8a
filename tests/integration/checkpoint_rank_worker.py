"""One gloo rank of test_checkpoint_ranks.py: `python checkpoint_rank_worker.py <scenario> <root> <results_dir>`.

Rank, world size and rendezvous come from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Each rank writes `<results_dir>/rank<R>.json` describing what it saw, then
leaves with os._exit so a dead peer can never hang process-group teardown.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as distributed

import astrai.checkpoint.publisher as publisher_module
from astrai.checkpoint import CheckpointError, CheckpointPublisher, StreamedFiles


def rank_writer(rank: int, fail_on_rank: int | None = None, exit_on_rank: int | None = None):
    """Write callback: policy/rank_<R>.bin on every rank, trainer_state.json + job.yaml on rank 0."""

    def write(staging: Path) -> None:
        (staging / "policy").mkdir(exist_ok=True)
        (staging / "policy" / f"rank_{rank}.bin").write_bytes(os.urandom(64 * 1024 + rank))
        if rank == 0:
            (staging / "trainer_state.json").write_text('{"step": 0}')
            (staging / "job.yaml").write_text("output_dir: test\n")
        if rank == fail_on_rank:
            raise RuntimeError(f"injected failure on rank {rank}")
        if rank == exit_on_rank:
            os._exit(17)  # a rank dying mid-save, without any cleanup

    return write


def divergent_writer(rank: int, root: Path):
    """(f) Write callback after which the ranks list different files in the (shared) staging directory.

    Rank 0 also writes `policy/node_local`, a symlink to `/proc/self/cwd/node_local`; each rank works
    from its own folder `<root>/node<R>` (the caller changes into it), where `node_local` is a folder
    for rank 0 and a file for rank 1. So one path in the staging directory is a folder (not followed)
    to rank 0 and a file to rank 1, as a path under which one node mounts local storage is on a
    multi-node job: rank 1 lists `policy/node_local`, rank 0 does not.
    """
    writer = rank_writer(rank)
    here = root / f"node{rank}"
    here.mkdir(exist_ok=True)
    (here / "node_local").mkdir() if rank == 0 else (here / "node_local").write_bytes(b"only rank 1 sees a file")

    def write(staging: Path) -> None:
        writer(staging)
        if rank == 0:
            (staging / "policy" / "node_local").symlink_to("/proc/self/cwd/node_local")

    return write


def streamed_writer(rank: int, claim_rank_zeros: bool = False):
    """(g) rank_writer's files plus policy/streamed_<R>.bin written through StreamedFiles, whose digests it
    returns; with `claim_rank_zeros`, rank 1 also reports rank 0's streamed file as one it wrote."""
    writer, files = rank_writer(rank), StreamedFiles("sha256")

    def write(staging: Path) -> dict:
        writer(staging)
        with files.open(staging / "policy" / f"streamed_{rank}.bin") as handle:
            handle.write(os.urandom(200 * 1024 + rank))
        digests = files.digests_under(staging)
        if claim_rank_zeros and rank == 1:
            digests["policy/streamed_0.bin"] = digests["policy/streamed_1.bin"]
        return digests

    return write


def recording_hash_shares(shares: list) -> None:
    """Record, per hash phase on this rank, which files it fsynced only (their digests known) and which it read."""
    original = publisher_module.hash_files

    def recording(root, paths, algorithm, *, known=None, **kwargs):
        known = known or {}
        shares.append(
            {
                "known": sorted(path for path in paths if path in known),
                "read": sorted(path for path in paths if path not in known),
            }
        )
        return original(root, paths, algorithm, known=known, **kwargs)

    publisher_module.hash_files = recording


def attempt(action) -> dict:
    """Run one publish; report its path or its error (message, type, type of the chained cause)."""
    started = time.monotonic()
    try:
        report = action()
        return {
            "ok": True,
            "path": str(report.path),
            "files": report.files,
            "hashed_while_written": report.hashed_while_written,
            "seconds": time.monotonic() - started,
        }
    except CheckpointError as error:
        return {
            "ok": False,
            "error": str(error),
            "type": type(error).__name__,
            "cause": type(error.__cause__).__name__ if error.__cause__ else None,
            "seconds": time.monotonic() - started,
        }


def suite(rank: int, root: Path) -> dict:
    """cleanup_stale, (a) normal publish, (b) failing write on rank 1, (c) steps disagree,
    (e) storage not shared, (f) ranks list different files, (g) files hashed while written, then a publish
    again on the same group."""
    group = distributed.new_group(backend="gloo", timeout=timedelta(seconds=30))
    publisher = CheckpointPublisher(root / "checkpoints", parts=["policy"], timeout_s=30, group=group)
    if rank == 0:  # left over by an earlier crash; cleanup_stale (rank 0 works, both ranks wait) removes it
        (root / "checkpoints" / ".step_00000005.staging-0dead").mkdir(parents=True)
    results = {"cleanup_removed": [str(path) for path in publisher.cleanup_stale().removed]}
    results["normal"] = attempt(lambda: publisher.publish(10, rank_writer(rank)))
    results["write_fails"] = attempt(lambda: publisher.publish(20, rank_writer(rank, fail_on_rank=1)))
    results["steps_disagree"] = attempt(lambda: publisher.publish(30 + rank, rank_writer(rank)))
    elsewhere = root / ("checkpoints" if rank == 0 else "node-local-disk")
    unshared = CheckpointPublisher(elsewhere, parts=["policy"], timeout_s=30, group=group)
    results["not_shared"] = attempt(lambda: unshared.publish(40, rank_writer(rank)))
    divergent = divergent_writer(rank, root)
    os.chdir(root / f"node{rank}")
    results["listings_differ"] = attempt(lambda: publisher.publish(60, divergent))
    os.chdir(root)
    shares = []
    recording_hash_shares(shares)
    results["streamed"] = attempt(lambda: publisher.publish(70, streamed_writer(rank)))
    results["streamed_shares"] = shares
    results["claimed_twice"] = attempt(lambda: publisher.publish(80, streamed_writer(rank, claim_rank_zeros=True)))
    results["after_failures"] = attempt(lambda: publisher.publish(50, rank_writer(rank)))
    return results


def rank_dies(rank: int, root: Path) -> dict:
    """(d) rank 1 exits inside its write callback; the publisher creates its own gloo group lazily."""
    publisher = CheckpointPublisher(root / "checkpoints", parts=["policy"], timeout_s=5)
    results = {"normal": attempt(lambda: publisher.publish(10, rank_writer(rank)))}
    results["peer_died"] = attempt(lambda: publisher.publish(20, rank_writer(rank, exit_on_rank=1)))
    return results


def rank_hangs(rank: int, root: Path) -> dict:
    """Rank 1 stalls inside its write callback (alive, silent) until rank 0 has reported, then exits."""
    publisher = CheckpointPublisher(root / "checkpoints", parts=["policy"], timeout_s=4)
    report_of_rank_zero = root / "results" / "rank0.json"
    writer = rank_writer(rank)

    def stall_on_rank_one(staging: Path) -> None:
        writer(staging)
        while rank == 1:
            if report_of_rank_zero.exists():
                os._exit(18)
            time.sleep(0.1)

    return {"peer_hung": attempt(lambda: publisher.publish(10, stall_on_rank_one))}


SCENARIOS = {"suite": suite, "rank_dies": rank_dies, "rank_hangs": rank_hangs}


def main() -> None:
    scenario, root, results_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = distributed.get_rank()
    results = SCENARIOS[scenario](rank, root)
    (results_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
