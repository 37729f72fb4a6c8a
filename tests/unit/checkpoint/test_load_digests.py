"""Damage is not laundered (issue #38): by default a resume compares every file it loads with the manifest.

Real checkpoints of the real trainer (one gloo rank, a real DeepSpeed engine, `test_trust.py`'s tiny SFT job,
step_1..step_4 published) and real files:
- one float of the weights in step_4's model-states file has an exponent bit flipped after publishing (the
  size is kept, the pickle still loads): the default resume falls back to step_3 with one warning naming
  the file ("wrong digest"), trains on, and the step_4 it publishes again holds the weights of the
  undamaged step_4, not the damaged float; with `checkpoint.verify_on_load: false` (the opt-out) the damaged
  float loads;
- a trainer_state.json that is not a valid state (wrong types, not JSON, not an object, an RNG entry that is
  not one, a flipped byte) falls back to step_3 with one warning naming the file and why; with an explicit
  `checkpoint.resume: <path>` it is one error;
- `read_check` and `verify_checkpoint(hash_later=...)` on their own: what is hashed, when, and what is raised.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from astrai.checkpoint import CheckpointError, CheckpointVerifyError, read_manifest, verify_checkpoint
from astrai.checkpoint.read_check import ReadCheck, checking_reads, read_checked
from tests.unit.checkpoint.test_trust import SETTINGS, SHARD, STEPS, edit_state, reseal, resume, train, train_in

EXPONENT_BIT = 0x40  # in a little-endian float32's top byte: the value scales by 2**64 or 2**-64


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_rank) -> dict:
    return train_in(tmp_path_factory.mktemp("load_digests"), one_rank)


@pytest.fixture
def job(trained, tmp_path) -> dict:
    output_dir = tmp_path / "job"
    shutil.copytree(trained["output_dir"], output_dir)
    checkpoints = output_dir / "checkpoints"
    return {**trained, "output_dir": output_dir, "checkpoints": checkpoints, "newest": checkpoints / "step_00000004"}


def module_weights(shard: Path) -> dict[str, torch.Tensor]:
    from astrai.engine import load_tensor_file

    return load_tensor_file(shard, map_location="cpu")["module"]


def flip_a_weight(shard: Path) -> tuple[str, int, float]:
    """Flip an exponent bit of the middle float of the largest weight, found in the file by its bytes:
    (parameter name, flat index, the damaged value). The file keeps its size and still loads."""
    name, tensor = max(module_weights(shard).items(), key=lambda item: item[1].numel())
    assert tensor.dtype == torch.float32
    raw, data = tensor.contiguous().view(torch.uint8).numpy().tobytes(), bytearray(shard.read_bytes())
    start = data.find(raw)
    assert start >= 0 and data.find(raw, start + 1) == -1, "the tensor's bytes are not found once in the file"
    index = tensor.numel() // 2
    data[start + 4 * index + 3] ^= EXPONENT_BIT
    shard.write_bytes(bytes(data))
    damaged = float(module_weights(shard)[name].flatten()[index])
    assert abs(damaged) > 1e6 or abs(damaged) < 1e-12, damaged
    return name, index, damaged


def damage_warnings(caplog) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and "is damaged" in record.getMessage()
    ]


def one_fallback(caplog, job: dict, file: str, reason: str) -> str:
    """The one warning of the resume: step_4 damaged (naming `file` and `reason`), step_3 loaded instead."""
    lines = damage_warnings(caplog)
    assert len(lines) == 1, lines
    previous = job["checkpoints"] / "step_00000003"
    assert f"checkpoint {job['newest']} is damaged (" in lines[0], lines[0]
    assert f"{job['newest']}/{file}" in lines[0] and reason in lines[0], lines[0]
    assert lines[0].endswith(f"resumed from the previous valid checkpoint {previous} instead"), lines[0]
    assert "\n" not in lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- a flipped bit in the weights


def test_a_flipped_weight_falls_back_by_default_and_is_not_published_again(job, one_rank, caplog):
    shard = job["newest"] / SHARD
    clean = module_weights(shard)
    name, index, damaged = flip_a_weight(shard)
    verify_checkpoint(job["newest"], digests=False)  # sizes and pickles agree: only the digest tells
    caplog.set_level(logging.INFO)
    overrides = [job["data"], *SETTINGS[1:], "train.max_steps=5", f"output_dir={job['output_dir']}"]
    state = train(job["config"], one_rank, *overrides)  # the default: checkpoint.verify_on_load true
    assert state.step == 5
    line = one_fallback(caplog, job, SHARD, "wrong digest")
    assert "as loaded, manifest says" in line
    assert "matched the manifest as they loaded" in caplog.text  # step_3's file, hashed beside its load
    verify_checkpoint(job["newest"])  # step_4 published again, whole
    republished = module_weights(shard)
    assert abs(float(republished[name].flatten()[index])) < 10.0
    for key, tensor in clean.items():  # step_3 + one step = the undamaged step_4 (one rank, CPU, same order)
        torch.testing.assert_close(republished[key], tensor, rtol=1e-5, atol=1e-6)
    assert float(republished[name].flatten()[index]) != damaged


def test_the_opt_out_loads_the_flipped_weight(job, one_rank, caplog):
    name, index, damaged = flip_a_weight(job["newest"] / SHARD)
    caplog.set_level(logging.INFO)
    state, run = resume(job, one_rank, "checkpoint.verify_on_load=false")
    assert state.step == STEPS and damage_warnings(caplog) == []
    loaded = dict(run.engines["policy"].module.named_parameters())[name]
    assert float(loaded.detach().flatten()[index]) == damaged  # what the opt-out accepts


def test_a_flipped_byte_anywhere_in_a_torch_file_falls_back(job, one_rank, caplog):
    """The middle byte of every torch file of step_4 (one here: ZeRO-0 on one rank keeps the optimizer in it)."""
    torch_files = [path for path in read_manifest(job["newest"]).files if path.endswith(".pt")]
    assert torch_files == [SHARD]
    for relative in torch_files:
        path = job["newest"] / relative
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    caplog.set_level(logging.INFO)
    state, _ = resume(job, one_rank)
    assert state.step == 3
    one_fallback(caplog, job, SHARD, "")  # a wrong digest, or unreadable when the byte broke the pickle


# ----------------------------------------------------------------------------- an invalid trainer_state.json


def not_json(checkpoint: Path) -> None:
    (checkpoint / "trainer_state.json").write_text('{"step": 4, "consumed_')


INVALID_STATES = {
    "wrong_type": (lambda c: edit_state(c, lambda d: d.__setitem__("consumed_samples", "lots")), "consumed_samples is"),
    "negative_count": (lambda c: edit_state(c, lambda d: d.__setitem__("step", -4)), "step is -4, expected a count"),
    "not_json": (not_json, "not valid JSON"),
    "not_an_object": (lambda c: (c / "trainer_state.json").write_text("[4]"), "expected a JSON object, got list"),
    "bad_rng_entry": (lambda c: edit_state(c, lambda d: d["rng"].__setitem__(0, 7)), "rng[0] must be an object"),
}


@pytest.mark.parametrize("damage", list(INVALID_STATES), ids=list(INVALID_STATES))
def test_an_invalid_trainer_state_falls_back_with_one_warning(job, one_rank, caplog, damage):
    change, reason = INVALID_STATES[damage]
    change(job["newest"])
    reseal(job["newest"])  # the manifest agrees with the file: only its content is wrong
    caplog.set_level(logging.INFO)
    state, _ = resume(job, one_rank)
    assert state.step == 3
    one_fallback(caplog, job, "trainer_state.json", reason)


def test_a_flipped_byte_in_trainer_state_is_a_wrong_digest(job, one_rank, caplog):
    path = job["newest"] / "trainer_state.json"
    path.write_bytes(path.read_bytes().replace(b'"step": 4', b'"step": 5'))  # same size, still valid JSON
    caplog.set_level(logging.INFO)
    state, _ = resume(job, one_rank)
    assert state.step == 3
    one_fallback(caplog, job, "trainer_state.json", "wrong digest")


def test_an_invalid_trainer_state_with_an_explicit_path_is_one_error(job, one_rank):
    edit_state(job["newest"], lambda document: document.__setitem__("consumed_samples", "lots"))
    reseal(job["newest"])
    with pytest.raises(CheckpointError) as error:
        resume(job, one_rank, f"checkpoint.resume={job['newest']}")
    message = str(error.value)
    assert message.startswith(f"cannot resume from {job['newest']}: {job['newest']}/trainer_state.json: ")
    assert "consumed_samples is 'lots' (str), expected int" in message and "\n" not in message


# ----------------------------------------------------------------------------- read_check on its own


@pytest.fixture
def sealed(job) -> tuple[Path, Path]:
    """step_4 and its torch file, with the manifest as published."""
    return job["newest"], job["newest"] / SHARD


def test_read_checked_hashes_the_files_of_the_active_check_only(sealed):
    checkpoint, shard = sealed
    manifest = read_manifest(checkpoint)
    check = ReadCheck(checkpoint, manifest, [SHARD])
    assert read_checked(shard, lambda: "read") == "read" and check.files == 0  # no active check: nothing hashed
    with checking_reads(check):
        assert read_checked(checkpoint / "job.yaml", lambda: "other") == "other"  # not one of its files
        assert read_checked(str(shard), lambda: "read") == "read"
        assert read_checked(shard, lambda: "again") == "again"  # matched once: not hashed again
    assert (check.files, check.bytes) == (1, manifest.files[SHARD].size)


def test_read_checked_raises_a_wrong_digest_after_the_read(sealed):
    checkpoint, shard = sealed
    check = ReadCheck(checkpoint, read_manifest(checkpoint), [SHARD])
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    reads = []
    with checking_reads(check), pytest.raises(CheckpointVerifyError) as error:
        read_checked(shard, lambda: reads.append(1))
    assert reads == [1] and error.value.reason == "wrong digest" and error.value.file == SHARD
    assert check.files == 0


def test_a_damaged_torch_file_under_a_check_is_damage_for_the_engine_load(sealed):
    from astrai.engine import CheckpointDamagedError, load_tensor_file

    checkpoint, shard = sealed
    flip_a_weight(shard)
    load_tensor_file(shard)  # outside a resume's check: it loads
    with checking_reads(ReadCheck(checkpoint, read_manifest(checkpoint), [SHARD])):
        with pytest.raises(CheckpointDamagedError, match=f"wrong digest: {shard}: .* as loaded, manifest says"):
            load_tensor_file(shard)


def test_verify_leaves_the_files_hashed_later_to_the_reader(sealed):
    checkpoint, shard = sealed
    flip_a_weight(shard)
    with pytest.raises(CheckpointVerifyError, match="wrong digest"):
        verify_checkpoint(checkpoint)
    report = verify_checkpoint(checkpoint, hash_later=[SHARD])
    manifest = read_manifest(checkpoint)
    assert report.files == len(manifest.files) - 1
    assert report.bytes == manifest.total_bytes - manifest.files[SHARD].size
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointVerifyError, match="wrong size"):  # the size of every file is still checked
        verify_checkpoint(checkpoint, hash_later=[SHARD])


def test_digests_are_checked_by_default_and_the_key_still_opts_out():
    from astrai.config.schema import CheckpointConfig

    assert CheckpointConfig().verify_on_load is True
    assert CheckpointConfig(verify_on_load=False).verify_on_load is False
