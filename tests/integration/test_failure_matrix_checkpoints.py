"""The failure matrix for damaged checkpoints (issue #38): damage published checkpoints, then resume.

In-process cases run `astrai.train.main(argv)` (one rank, as tests/integration/test_failure_matrix.py does):
a run publishes step_1..step_3, one file of step_3 is damaged, and a second `main` resumes:
- a float of the weights with an exponent bit flipped (size kept, the pickle loads): exit 0, ONE warning
  naming the file and "wrong digest", the run resumes from step_2 and publishes step_3 again, valid;
- the same with `checkpoint.verify_on_load: false` (the opt-out): exit 0, no warning, resumed from step_3;
- a trainer_state.json of wrong types (manifest resealed): exit 0, ONE warning naming the file and the key;
- the same with `checkpoint.resume: <step_3>`: exit 1, ONE error line naming the file and the key.
`test_two_ranks_fall_back_together` launches 2 real ZeRO-2 ranks once (tests/integration/run_plan.py): a
byte flipped in rank 1's optimizer shard, then a trainer_state.json of wrong types; both ranks fall back
together each time and train on.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest

from astrai.checkpoint import read_manifest, verify_checkpoint
from astrai.checkpoint.hashing import hash_file
from astrai.checkpoint.manifest import write_manifest
from tests.conftest import REPO
from tests.integration.plan import launch_plan, metrics, write_job
from tests.integration.test_failure_matrix import JOB, SMALL_MODEL
from tests.integration.test_failure_matrix import run_main as run_job

# test_failure_matrix's job, run 3 steps with a checkpoint after each (every run of the folder passes these first).
CHECKPOINTED = ["train.max_steps=3", "checkpoint.every_steps=1"]
SHARD = "policy/state/mp_rank_00_model_states.pt"
HERE = "tests.integration.test_failure_matrix_checkpoints"
RANK1_SHARD = "policy/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.fixture
def trained(tmp_path, monkeypatch, capfd) -> dict:
    """A job folder whose run published step_1..step_3; the environment and logging restored afterwards."""
    lines = (REPO / "data/arithmetic/sft.jsonl").read_text().splitlines()[:20]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "job.yaml").write_text(JOB.format(folder=tmp_path, model=SMALL_MODEL))
    saved = dict(os.environ)
    code, output = run_main(tmp_path, [], capfd)
    assert code == 0, output[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    yield {"folder": tmp_path, "checkpoints": checkpoints, "newest": checkpoints / "step_00000003"}
    os.environ.clear()
    os.environ.update(saved)
    logging.getLogger().handlers.clear()


def run_main(folder: Path, overrides: list[str], capfd) -> tuple[int, str]:
    """test_failure_matrix's run of the folder's job.yaml in this process, with CHECKPOINTED before `overrides`."""
    return run_job(str(folder / "job.yaml"), CHECKPOINTED + overrides, capfd)


def reseal(checkpoint: Path) -> None:
    manifest = read_manifest(checkpoint)
    files = {path: hash_file(checkpoint / path, manifest.hash_algorithm) for path in manifest.files}
    write_manifest(checkpoint, replace(manifest, files=files))


def flip_a_float(path: Path) -> None:
    """An exponent bit of a float32 in the middle of the file's largest tensor record (the size is kept)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        records = [info for info in archive.infolist() if "/data/" in info.filename]
    record = max(records, key=lambda info: info.file_size)
    data = bytearray(path.read_bytes())
    header = record.header_offset  # the local header's own name and extra lengths (torch pads the extra field)
    start = header + 30 + int.from_bytes(data[header + 26 : header + 28], "little")
    start += int.from_bytes(data[header + 28 : header + 30], "little")
    data[start + (record.file_size // 8) * 4 + 3] ^= 0x40
    path.write_bytes(bytes(data))


def wrong_types(checkpoint: Path) -> None:
    path = checkpoint / "trainer_state.json"
    document = json.loads(path.read_text())
    document["consumed_samples"] = "lots"
    path.write_text(json.dumps(document))
    reseal(checkpoint)


def damage_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "is damaged" in line]


def test_a_flipped_weight_falls_back_by_default(trained, capfd):
    flip_a_float(trained["newest"] / SHARD)
    code, output = run_main(trained["folder"], ["train.max_steps=4"], capfd)
    assert code == 0 and "Traceback" not in output, output[-3000:]
    lines = damage_lines(output)
    assert len(lines) == 1, output[-3000:]
    assert f"wrong digest: {trained['newest']}/{SHARD}: " in lines[0]
    assert f"previous valid checkpoint {trained['checkpoints'] / 'step_00000002'} instead" in lines[0]
    assert "done: 4 steps" in output
    for step in (3, 4):
        verify_checkpoint(trained["checkpoints"] / f"step_{step:08d}")  # step_3 published again, whole


def test_the_opt_out_resumes_the_damaged_weights(trained, capfd):
    flip_a_float(trained["newest"] / SHARD)
    code, output = run_main(trained["folder"], ["train.max_steps=4", "checkpoint.verify_on_load=false"], capfd)
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert damage_lines(output) == [] and f"resumed from {trained['newest']} at step 3" in output


def test_an_invalid_trainer_state_falls_back(trained, capfd):
    wrong_types(trained["newest"])
    code, output = run_main(trained["folder"], ["train.max_steps=4"], capfd)
    assert code == 0 and "Traceback" not in output, output[-3000:]
    lines = damage_lines(output)
    assert len(lines) == 1, output[-3000:]
    assert f"{trained['newest']}/trainer_state.json: consumed_samples is 'lots' (str), expected int" in lines[0]
    assert f"previous valid checkpoint {trained['checkpoints'] / 'step_00000002'} instead" in lines[0]


def test_an_invalid_trainer_state_with_a_resume_path_is_one_line(trained, capfd):
    wrong_types(trained["newest"])
    code, output = run_main(trained["folder"], ["train.max_steps=4", f"checkpoint.resume={trained['newest']}"], capfd)
    assert code == 1 and "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if " ERROR astrai:" in line or line.startswith("astrai:")]
    assert len(errors) == 1, output[-3000:]
    assert f"cannot resume from {trained['newest']}: {trained['newest']}/trainer_state.json: " in errors[0]
    assert "consumed_samples is 'lots'" in errors[0] and damage_lines(output) == []


# ----------------------------------------------------------------------------- two ranks, one launch


def flip_rank1_shard(checkpoint: str) -> None:
    """(rank 0, before a run) a float of rank 1's optimizer shard; the manifest left as published."""
    flip_a_float(Path(checkpoint) / RANK1_SHARD)


def wrong_types_in_state(checkpoint: str) -> None:
    wrong_types(Path(checkpoint))


@pytest.mark.slow
def test_two_ranks_fall_back_together(tmp_path):
    config = write_job(tmp_path, "job")
    checkpoints = tmp_path / "job" / "checkpoints"
    common = ["checkpoint.every_steps=1", "checkpoint.keep_last=null", "train.micro_batch_size=4"]
    runs = [
        {"name": "base", "config": config, "set": [*common, "train.max_steps=4"]},
        {
            "name": "flipped",
            "config": config,
            "set": [*common, "train.max_steps=5"],
            "prepare": [f"{HERE}:flip_rank1_shard", str(checkpoints / "step_00000004")],
        },
        {
            "name": "state",
            "config": config,
            "set": [*common, "train.max_steps=6"],
            "prepare": [f"{HERE}:wrong_types_in_state", str(checkpoints / "step_00000005")],
        },
    ]
    results = launch_plan(tmp_path, runs)
    log = (tmp_path / "launch.log").read_text()
    assert results["flipped"] == {"ok": True, "error": None, "step": 5}, results
    assert results["state"] == {"ok": True, "error": None, "step": 6}, results
    lines = damage_lines(log)
    assert len(lines) == 2, lines  # rank 0 alone says it, once per fallback
    assert f"wrong digest: {checkpoints}/step_00000004/{RANK1_SHARD}: " in lines[0]
    assert f"previous valid checkpoint {checkpoints}/step_00000003 instead" in lines[0]
    assert f"{checkpoints}/step_00000005/trainer_state.json: consumed_samples is 'lots'" in lines[1]
    assert f"previous valid checkpoint {checkpoints}/step_00000004 instead" in lines[1]
    assert sorted(record["step"] for record in metrics(tmp_path, "job")) == list(range(1, 7))
    for step in (4, 5, 6):
        verify_checkpoint(checkpoints / f"step_{step:08d}")
