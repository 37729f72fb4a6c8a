"""Trust and damage on resume (issue #22, items 1 and 3), on real checkpoints of the real trainer.

One tiny SFT job trains 4 steps in this process (one gloo rank, real DeepSpeed engine), publishing
step_1..step_4; each test copies that output_dir and damages or crafts a file of the copy:
- a trainer_state.json whose RNG state is a pickle of `os.system("touch <marker>")`, and a shard
  holding the same payload (both resealed into the manifest, so the checkpoint verifies by size and
  digest): resume, `export-hf` and `verify` refuse naming the file, and the marker never appears;
- a checkpoint written by the previous code (RNG states as base64 pickles) resumes with exactly the
  RNG states the JSON one gives;
- a truncated shard (caught by the quick size check, or while loading when the manifest agrees with
  the truncated size) and a flipped byte (caught by verify_on_load, the default: test_load_digests.py)
  fall back to step_3 with one warning naming both, and training continues; a FIFO as job.yaml is
  refused without blocking; a manifest whose step is not the folder's is refused; a trainer_state.json
  of wrong types falls back too (the real `train.py`, exit status 0), a larger model ends in one line
  (exit status 1, no traceback).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy
import pytest
import torch

from astrai.checkpoint import CheckpointError, read_manifest, verify_checkpoint, verify_main
from astrai.checkpoint.hashing import hash_file
from astrai.checkpoint.manifest import write_manifest
from astrai.export.cli import export_main
from astrai.resume.rng_state import capture_rng, decode_rng, restore_rng
from tests.conftest import REPO, child_env, run_bounded
from tests.integration.plan import write_job

STEPS = 4
SETTINGS = [f"train.max_steps={STEPS}", "checkpoint.every_steps=1", "checkpoint.keep_last=null"]
SHARD = "policy/state/mp_rank_00_model_states.pt"  # one rank, ZeRO-2 runs as ZeRO-0: the whole state in one file


class Payload:
    """Pickles as a call of os.system: what a crafted checkpoint runs when unpickled by plain pickle."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_rank) -> dict:
    return train_in(tmp_path_factory.mktemp("trust"), one_rank)


def train_in(folder: Path, one_rank) -> dict:
    """An sft run of STEPS steps on 64 arithmetic rows in `folder`: its config, output_dir and data override."""
    rows = (REPO / "data/arithmetic/sft.jsonl").read_text().splitlines(keepends=True)[:64]
    (folder / "rows.jsonl").write_text("".join(rows))
    config = write_job(folder, "job")
    state = train(config, one_rank, f"data.path={folder / 'rows.jsonl'}", *SETTINGS)
    assert state.step == STEPS
    return {"config": config, "output_dir": folder / "job", "data": f"data.path={folder / 'rows.jsonl'}"}


def build(config: str, dist, *overrides: str):
    from astrai.launch.job_checks import load_and_check
    from astrai.training.build import build_run

    job = load_and_check(config, list(overrides))
    return build_run(job, dist, config)


def train(config: str, dist, *overrides: str):
    from astrai.training.loops import TRAIN_LOOPS

    run = build(config, dist, *overrides)
    return TRAIN_LOOPS[run.strategy.loop](run)


def resume(job: dict, dist, *overrides: str):
    """What a resume of the copied job loads: (TrainerState, the run)."""
    from astrai.resume.training_checkpoints import TrainingCheckpoints

    run = build(job["config"], dist, job["data"], *SETTINGS, f"output_dir={job['output_dir']}", *overrides)
    return TrainingCheckpoints(run).resume(), run


@pytest.fixture
def job(trained, tmp_path) -> dict:
    """A copy of the trained output_dir, its checkpoints' own to damage."""
    output_dir = tmp_path / "job"
    shutil.copytree(trained["output_dir"], output_dir)
    checkpoints = output_dir / "checkpoints"
    return {**trained, "output_dir": output_dir, "checkpoints": checkpoints, "newest": checkpoints / "step_00000004"}


def reseal(checkpoint: Path) -> None:
    """Rewrite the manifest's sizes and digests to the files as they are now: the checkpoint verifies."""
    manifest = read_manifest(checkpoint)
    files = {path: hash_file(checkpoint / path, manifest.hash_algorithm) for path in manifest.files}
    write_manifest(checkpoint, replace(manifest, files=files))


def old_format_entry(entry: dict) -> str:
    """An RNG entry as the code before the JSON format wrote it: base64 of a pickle of the native states."""
    version, words, gauss_next = entry["python"]
    name, keys, position, has_gauss, cached = entry["numpy"]
    tensor = torch.frombuffer(bytearray(base64.b64decode(entry["torch"])), dtype=torch.uint8).clone()
    snapshot = {
        "python": (version, tuple(words), gauss_next),
        "numpy": (name, numpy.asarray(keys, dtype=numpy.uint32), position, has_gauss, cached),
        "torch": tensor,
    }
    return base64.b64encode(pickle.dumps(snapshot)).decode()


def draws() -> tuple:
    return random.random(), float(numpy.random.rand()), float(torch.rand(1))


def edit_state(checkpoint: Path, change) -> None:
    path = checkpoint / "trainer_state.json"
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


# ----------------------------------------------------------------------------- RNG states as data


def test_rng_states_are_json_data_and_restore_exactly():
    entry = json.loads(json.dumps(capture_rng()))  # through JSON and back: nothing but data
    expected = draws()
    draws()
    restore_rng(entry)
    assert draws() == expected
    restore_rng(old_format_entry(entry))  # the pickled format of earlier checkpoints gives the same states
    assert draws() == expected


def test_a_pickled_rng_state_naming_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "marker"
    crafted = base64.b64encode(pickle.dumps({"python": Payload(marker)})).decode()
    refusal = "trainer_state.json: refused: an RNG state is a pickle naming posix.system"
    with pytest.raises(CheckpointError, match=refusal):
        decode_rng(crafted, Path("trainer_state.json"), 0)
    assert not marker.exists()


# ----------------------------------------------------------------------------- crafted checkpoints


def craft_rng(job: dict, marker: Path) -> Path:
    crafted = base64.b64encode(pickle.dumps(Payload(marker))).decode()
    edit_state(job["newest"], lambda document: document["rng"].__setitem__(0, crafted))
    reseal(job["newest"])
    verify_checkpoint(job["newest"], digests=False)  # sizes and digests agree: only the content is crafted
    return job["newest"] / "trainer_state.json"


def craft_shard(job: dict, marker: Path) -> Path:
    shard = job["newest"] / SHARD
    states = torch.load(shard, weights_only=True)
    states["payload"] = Payload(marker)
    torch.save(states, shard)
    reseal(job["newest"])
    return shard


@pytest.mark.parametrize("craft", [craft_rng, craft_shard], ids=["trainer_state_rng", "shard"])
def test_a_crafted_checkpoint_is_refused_by_resume_export_and_verify(job, one_rank, tmp_path, capsys, craft):
    marker = tmp_path / "marker"
    crafted = craft(job, marker)
    with pytest.raises(CheckpointError, match=f"{crafted}.*posix.system") as refused:
        resume(job, one_rank)  # refused, never skipped for the older checkpoint
    assert "refused" in str(refused.value) and "\n" not in str(refused.value)

    assert verify_main([str(job["newest"])]) == 1
    printed = capsys.readouterr().out
    assert f"INVALID  {job['newest']}: unsafe pickle: {crafted.relative_to(job['newest'])}" in printed
    assert "posix.system" in printed

    # Verified first (the default), then loaded weights-only without it; an export reads no trainer_state.json.
    for extra in ([], ["--no-verify"]) if craft is craft_shard else ([],):
        assert export_main([str(job["newest"]), str(tmp_path / f"hf{len(extra)}"), *extra]) == 1
        error = capsys.readouterr().err
        assert str(crafted) in error and "posix.system" in error and "refused" in error, error
    assert not marker.exists()


def test_a_shard_naming_code_is_refused_by_the_engine_load_itself(job, one_rank, tmp_path):
    """The load path on its own (the static pre-check aside): DeepSpeed's load through AstrAI's checkpoint engine."""
    from astrai.engine import UnsafeCheckpointError

    marker = tmp_path / "marker"
    shard = craft_shard(job, marker)
    run = build(job["config"], one_rank, job["data"], *SETTINGS, f"output_dir={job['output_dir']}")
    with pytest.raises(UnsafeCheckpointError, match=f"{shard}: refused: holds a pickle naming posix.system"):
        run.engines["policy"].load(job["newest"] / "policy")
    assert not marker.exists()


def test_an_old_format_checkpoint_resumes_exactly(job, one_rank):
    expected_state, run = resume(job, one_rank)
    expected = draws()
    weights = {name: tensor.clone() for name, tensor in run.engines["policy"].module.state_dict().items()}
    edit_state(job["newest"], lambda document: document.update(rng=list(map(old_format_entry, document["rng"]))))
    assert isinstance(json.loads((job["newest"] / "trainer_state.json").read_text())["rng"][0], str)
    reseal(job["newest"])
    state, run = resume(job, one_rank)
    assert draws() == expected and state.step == expected_state.step == STEPS
    assert state.consumed_samples == expected_state.consumed_samples
    assert all(torch.equal(tensor, weights[name]) for name, tensor in run.engines["policy"].module.state_dict().items())


# ----------------------------------------------------------------------------- damage: fall back


def fell_back(caplog, job) -> bool:
    previous = job["checkpoints"] / "step_00000003"
    lines = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    damaged = f"checkpoint {job['newest']} is damaged"
    fallback = f"resumed from the previous valid checkpoint {previous}"
    return any(damaged in line and fallback in line for line in lines)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_truncated_shard_falls_back_to_the_previous_checkpoint_and_training_continues(job, one_rank, caplog):
    truncate(job["newest"] / SHARD)
    caplog.set_level(logging.INFO)
    overrides = [job["data"], *SETTINGS[1:], "train.max_steps=5", f"output_dir={job['output_dir']}"]
    state = train(job["config"], one_rank, *overrides)
    assert fell_back(caplog, job), caplog.text[-3000:]
    assert "wrong size" in caplog.text and state.step == 5
    steps = [json.loads(line)["step"] for line in (job["output_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]  # step 4's record trimmed and trained again
    verify_checkpoint(job["newest"])  # republished whole


def test_a_shard_truncated_before_sealing_is_found_before_loading(job, one_rank, caplog):
    """The manifest agrees with the truncated size (written so): the pre-load scan of the zip's directory finds it."""
    truncate(job["newest"] / SHARD)
    reseal(job["newest"])
    caplog.set_level(logging.INFO)
    state, _ = resume(job, one_rank)
    assert state.step == 3 and fell_back(caplog, job) and "unreadable" in caplog.text


def test_a_flipped_byte_is_caught_by_verify_on_load_and_falls_back(job, one_rank, caplog):
    shard = job["newest"] / SHARD
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    caplog.set_level(logging.INFO)
    state, _ = resume(job, one_rank, "checkpoint.verify_on_load=true")
    assert state.step == 3 and fell_back(caplog, job) and "wrong digest" in caplog.text


def test_damage_with_an_explicit_resume_path_is_an_error_not_a_fallback(job, one_rank):
    truncate(job["newest"] / SHARD)
    with pytest.raises(CheckpointError, match=f"cannot resume from {job['newest']}: .*wrong size"):
        resume(job, one_rank, f"checkpoint.resume={job['newest']}")


def test_no_valid_checkpoint_left_is_one_clear_error(job, one_rank):
    for step in range(1, STEPS + 1):
        truncate(job["checkpoints"] / f"step_{step:08d}" / SHARD)
    with pytest.raises(CheckpointError, match=f"no valid checkpoint to resume from: {job['newest']} is damaged"):
        resume(job, one_rank)


class Alarm(Exception):
    pass


def test_a_fifo_as_job_yaml_is_refused_without_blocking(job, one_rank, tmp_path, caplog, capsys):
    job_yaml = job["newest"] / "job.yaml"
    job_yaml.unlink()
    os.mkfifo(job_yaml)

    def ring(signum, frame):
        raise Alarm("a reader blocked on the FIFO")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(60)  # a blocked open() is interrupted, so the test fails instead of hanging
    try:
        caplog.set_level(logging.INFO)
        state, _ = resume(job, one_rank)
        assert state.step == 3 and fell_back(caplog, job) and "special file" in caplog.text
        with pytest.raises(CheckpointError, match="special file"):
            resume(job, one_rank, f"checkpoint.resume={job['newest']}")
        assert verify_main([str(job["newest"]), "--quick"]) == 1
        assert "special file: job.yaml" in capsys.readouterr().out
        assert export_main([str(job["newest"]), str(tmp_path / "hf"), "--no-verify"]) == 1
        assert "job.yaml: not a regular file" in capsys.readouterr().err
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_manifest_whose_step_is_not_the_folders_is_refused(job, one_rank, caplog, capsys):
    manifest = read_manifest(job["newest"])
    write_manifest(job["newest"], replace(manifest, step=7))
    state, _ = resume(job, one_rank)  # auto: skipped, as any checkpoint that is not valid
    assert state.step == 3 and "manifest says step 7, the directory name says 4" in caplog.text
    with pytest.raises(CheckpointError, match="step mismatch.*the manifest says step 7, the folder name step 4"):
        resume(job, one_rank, f"checkpoint.resume={job['newest']}")
    assert verify_main([str(job["newest"]), "--quick"]) == 1
    assert "step mismatch" in capsys.readouterr().out


# ----------------------------------------------------------------------------- job errors: one line, exit 1


def run_train(job: dict, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "astrai/train.py", "--config", job["config"]]
    for override in (job["data"], *SETTINGS, "train.max_steps=5", f"output_dir={job['output_dir']}", *overrides):
        command += ["--set", override]
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    environment = {key: value for key, value in child_env().items() if key not in launcher}
    return run_bounded(command, 300, cwd=REPO, env=environment)


@pytest.mark.slow
def test_wrong_types_in_trainer_state_fall_back_and_a_larger_model_ends_in_one_line(job):
    state_file = job["newest"] / "trainer_state.json"
    edit_state(job["newest"], lambda document: document.__setitem__("consumed_samples", "lots"))
    reseal(job["newest"])
    finished = run_train(job)  # damage (issue #38): the previous checkpoint loads, one warning says why
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0 and "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if "is damaged" in line]
    assert len(lines) == 1 and f"{state_file}: consumed_samples is 'lots' (str), expected int" in lines[0], lines
    assert f"resumed from the previous valid checkpoint {job['checkpoints'] / 'step_00000003'}" in lines[0]

    finished = run_train(job, "model.init.hidden_size=64")  # the checkpoint's model has hidden_size 32
    output = finished.stdout + finished.stderr
    assert finished.returncode == 1 and "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if "has shape [" in line]
    assert len(lines) == 1 and "parameter model.embed_tokens.weight has shape [" in lines[0], output[-3000:]
    assert ", 32] in the checkpoint but [" in lines[0] and ", 64] in this job's model" in lines[0]
    assert "resumed from the previous" not in output  # not damage: no fallback
