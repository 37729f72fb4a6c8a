"""Damage and crafted files on resume with 2 real DeepSpeed ranks (ZeRO-2: a shard per rank), ONE launch.

In order, on one output_dir (tests/integration/run_plan.py; each `prepare` runs on rank 0 before its run):
1. `base`: 6 steps, a checkpoint at every step.
2. `truncated`: rank 1's optimizer shard of step_6 cut in half. Rank 0's size check finds it; both ranks
   fall back to step_5 together and train to step 8: step 6's loss equals the base run's (same weights,
   Adam moments, RNG and data position as when the base run trained it).
3. `sealed`: rank 1's shard of step_8 cut in half and the manifest rewritten to agree (a shard written
   truncated): the pre-load scan of its zip directory finds it; both ranks fall back to step_7, train to 9.
4. `larger`: the model's hidden_size doubled: one error naming the parameter and both shapes, on both
   ranks (no fallback: the checkpoint is fine, the job is not).
5. `payload`: rank 1's shard of step_9 holds a pickle calling os.system (manifest resealed): refused on
   both ranks naming the file; the marker file it would create never appears.
A rank that went on alone would hang the launch at run_plan's barrier: its success shows the ranks agreed.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from astrai.checkpoint import read_manifest, verify_checkpoint
from astrai.checkpoint.hashing import hash_file
from astrai.checkpoint.manifest import write_manifest
from tests.integration.plan import launch_plan, metrics, write_job

pytestmark = pytest.mark.slow
HERE = "tests.integration.test_trust_ranks"
RANK1_SHARD = "policy/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"
COMMON = ["checkpoint.every_steps=1", "checkpoint.keep_last=null", "train.micro_batch_size=4"]


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def reseal(checkpoint: Path) -> None:
    manifest = read_manifest(checkpoint)
    files = {path: hash_file(checkpoint / path, manifest.hash_algorithm) for path in manifest.files}
    write_manifest(checkpoint, replace(manifest, files=files))


def truncate(checkpoint: str, relative: str, seal: bool, keep_metrics: str | None = None) -> None:
    """(rank 0, before a run) cut a file in half; `seal`: rewrite the manifest to agree; copy the metric log aside."""
    if keep_metrics:
        shutil.copy(Path(checkpoint).parents[1] / "metrics.jsonl", keep_metrics)
    path = Path(checkpoint) / relative
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    if seal:
        reseal(Path(checkpoint))


def plant_payload(checkpoint: str, relative: str, marker: str) -> None:
    path = Path(checkpoint) / relative
    states = torch.load(path, weights_only=False)  # this test's own file, written by the run just before
    states["payload"] = Payload(marker)
    torch.save(states, path)
    reseal(Path(checkpoint))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trust_ranks")
    config = write_job(folder, "job")
    checkpoints = folder / "job" / "checkpoints"
    marker, base_metrics = folder / "marker", folder / "base_metrics.jsonl"
    runs = [
        {"name": "base", "config": config, "set": [*COMMON, "train.max_steps=6"]},
        {
            "name": "truncated",
            "config": config,
            "set": [*COMMON, "train.max_steps=8"],
            "prepare": [f"{HERE}:truncate", str(checkpoints / "step_00000006"), RANK1_SHARD, False, str(base_metrics)],
        },
        {
            "name": "sealed",
            "config": config,
            "set": [*COMMON, "train.max_steps=9"],
            "prepare": [f"{HERE}:truncate", str(checkpoints / "step_00000008"), RANK1_SHARD, True],
        },
        {
            "name": "larger",
            "config": config,
            "set": [*COMMON, "train.max_steps=10", "model.init.hidden_size=64"],
            "expect_error": "shape",
        },
        {
            "name": "payload",
            "config": config,
            "set": [*COMMON, "train.max_steps=10"],
            "expect_error": "refused",
            "prepare": [f"{HERE}:plant_payload", str(checkpoints / "step_00000009"), RANK1_SHARD, str(marker)],
        },
    ]
    results = launch_plan(folder, runs)
    log = (folder / "launch.log").read_text()
    return {"folder": folder, "results": results, "log": log, "checkpoints": checkpoints, "marker": marker}


def test_damage_on_one_ranks_shard_falls_back_on_both_ranks_and_training_continues(launched):
    results, log, checkpoints = launched["results"], launched["log"], launched["checkpoints"]
    assert results["base"]["ok"] and results["base"]["step"] == 6, results
    assert results["truncated"] == {"ok": True, "error": None, "step": 8}, results
    assert results["sealed"] == {"ok": True, "error": None, "step": 9}, results
    for damaged, previous, why in ((6, 5, "wrong size"), (8, 7, "unreadable")):
        damage = f"checkpoint {checkpoints}/step_{damaged:08d} is damaged"
        line = next(line for line in log.splitlines() if damage in line)
        assert why in line and RANK1_SHARD in line
        assert f"previous valid checkpoint {checkpoints}/step_{previous:08d} instead" in line
    assert log.count("resumed from the previous valid checkpoint") == 2  # rank 0 alone says it, once per fallback
    base_lines = (launched["folder"] / "base_metrics.jsonl").read_text().splitlines()
    base = {record["step"]: record for record in map(json.loads, base_lines)}
    resumed = {record["step"]: record for record in metrics(launched["folder"], "job")}
    assert sorted(resumed) == list(range(1, 10))
    assert resumed[6]["loss"] == pytest.approx(base[6]["loss"], rel=1e-6)  # step 6 trained again from step 5's state
    for step in (6, 8):
        verify_checkpoint(checkpoints / f"step_{step:08d}")  # republished whole


def test_job_errors_and_crafted_shards_stop_both_ranks_with_one_line(launched):
    results, checkpoints = launched["results"], launched["checkpoints"]
    larger = results["larger"]
    assert not larger["ok"] and "parameter model.embed_tokens.weight has shape [" in larger["error"], larger
    assert ", 32] in the checkpoint but [" in larger["error"] and ", 64] in this job's model" in larger["error"]
    payload = results["payload"]
    assert not payload["ok"] and f"{checkpoints}/step_00000009/{RANK1_SHARD}" in payload["error"], payload
    assert "posix.system" in payload["error"]
    assert "\n" not in larger["error"] + payload["error"]
    assert not launched["marker"].exists()
    assert read_manifest(checkpoints / "step_00000009").step == 9  # refused, not skipped: nothing was republished
