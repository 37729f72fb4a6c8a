"""Read side: verify_checkpoint, find_latest, require_parts, read_manifest, names, and the verify CLI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.checkpoint import (
    CheckpointError,
    CheckpointPublisher,
    CheckpointVerifyError,
    LegacyCheckpointError,
    find_latest,
    parse_step_dir_name,
    read_manifest,
    require_parts,
    step_dir_name,
    verify_checkpoint,
    verify_main,
)
from astrai.checkpoint.layout import parse_hidden_dir_name, staging_dir_name
from astrai.checkpoint.manifest import MANIFEST_NAME, is_safe_relative_path
from astrai.checkpoint.publisher import describe_listing_difference

REPOSITORY = Path(__file__).resolve().parents[3]


def write_payload(staging: Path) -> None:
    (staging / "policy").mkdir()
    (staging / "policy" / "a.pt").write_bytes(bytes(range(256)) * 40)
    (staging / "policy" / "b.pt").write_bytes(b"b" * 5000)
    (staging / "trainer_state.json").write_text('{"step": 1}')


def publish(root: Path, step: int, **options) -> Path:
    return CheckpointPublisher(root, parts=["policy"], **options).publish(step, write_payload).path


def edit_manifest(checkpoint: Path, **changes) -> None:
    document = json.loads((checkpoint / MANIFEST_NAME).read_text())
    document.update(changes)
    (checkpoint / MANIFEST_NAME).write_text(json.dumps(document))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped byte": (lambda checkpoint: flip_byte(checkpoint / "policy" / "b.pt"), "wrong digest", "policy/b.pt"),
    "truncated": (
        lambda checkpoint: (checkpoint / "policy" / "a.pt").write_bytes(b"short"),
        "wrong size",
        "policy/a.pt",
    ),
    "deleted": (lambda checkpoint: (checkpoint / "trainer_state.json").unlink(), "missing", "trainer_state.json"),
    "extra": (
        lambda checkpoint: (checkpoint / "policy" / "stray.tmp").write_bytes(b""),
        "unexpected file",
        "policy/stray.tmp",
    ),
    "corrupt manifest": (
        lambda checkpoint: (checkpoint / MANIFEST_NAME).write_text('{"format": '),
        "bad manifest",
        MANIFEST_NAME,
    ),
    "future version": (lambda checkpoint: edit_manifest(checkpoint, version=2), "bad manifest", MANIFEST_NAME),
    "unknown hash": (lambda checkpoint: edit_manifest(checkpoint, hash="md5"), "bad manifest", MANIFEST_NAME),
    "other format": (lambda checkpoint: edit_manifest(checkpoint, format="torch-dcp"), "bad manifest", MANIFEST_NAME),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_each_corruption_is_named(tmp_path, corruption):
    checkpoint = publish(tmp_path, 1)
    damage, reason, bad_file = CORRUPTIONS[corruption]
    damage(checkpoint)
    with pytest.raises(CheckpointVerifyError) as raised:
        verify_checkpoint(checkpoint)
    assert (raised.value.reason, raised.value.file) == (reason, bad_file)
    assert f"{checkpoint}/{bad_file}" in str(raised.value)


def test_manifest_errors_are_clear_and_never_legacy(tmp_path):
    checkpoint = publish(tmp_path, 1)
    edit_manifest(checkpoint, version=2)
    with pytest.raises(CheckpointError, match=r"written by a newer AstrAI \(manifest version 2"):
        read_manifest(checkpoint)
    edit_manifest(checkpoint, version=1, hash="md5")
    with pytest.raises(CheckpointError, match="unknown hash algorithm 'md5'"):
        read_manifest(checkpoint)
    edit_manifest(checkpoint, hash="sha256", format="other")
    with pytest.raises(CheckpointError, match="not an AstrAI checkpoint manifest"):
        read_manifest(checkpoint)
    edit_manifest(checkpoint, format="astrai-checkpoint", files={"../outside": {"size": 1, "digest": "00"}})
    with pytest.raises(CheckpointError, match="invalid file path '../outside'"):
        read_manifest(checkpoint)
    (checkpoint / MANIFEST_NAME).write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match="corrupt manifest"):
        read_manifest(checkpoint)


def test_the_first_bad_file_is_named(tmp_path):
    checkpoint = publish(tmp_path, 1)
    flip_byte(checkpoint / "policy" / "a.pt")
    flip_byte(checkpoint / "policy" / "b.pt")
    with pytest.raises(CheckpointVerifyError) as raised:
        verify_checkpoint(checkpoint, hash_threads=2)
    assert raised.value.file == "policy/a.pt"
    report = verify_checkpoint(checkpoint, digests=False)  # sizes still match
    assert report.files == 3 and not report.digests_checked


def test_find_latest_skips_invalid_and_hidden(tmp_path, caplog):
    for step in (9, 10, 11, 12):
        publish(tmp_path, step)
    (tmp_path / step_dir_name(10)).rename(tmp_path / "step_10")  # unpadded names sort numerically
    (tmp_path / step_dir_name(11)).rename(tmp_path / "step_000011")
    for kind in ("staging", "retired"):
        hidden = tmp_path / f".{step_dir_name(99)}.{kind}-abc123"
        hidden.mkdir()
        (hidden / MANIFEST_NAME).write_text("{}")
    (tmp_path / step_dir_name(13)).mkdir()
    (tmp_path / step_dir_name(13) / MANIFEST_NAME).write_text("not json")
    (tmp_path / "step_notanumber").mkdir()
    (tmp_path / step_dir_name(14)).write_text("a file, not a directory")

    with caplog.at_level(logging.WARNING):
        assert find_latest(tmp_path) == tmp_path / step_dir_name(12)
    assert "skipping checkpoint" in caplog.text and "step_00000013" in caplog.text

    flip_byte(tmp_path / step_dir_name(12) / "policy" / "a.pt")
    assert find_latest(tmp_path) == tmp_path / step_dir_name(12)  # without verify, only the manifest is read
    assert find_latest(tmp_path, verify=True) == tmp_path / "step_000011"
    edit_manifest(tmp_path / "step_000011", step=5)  # a manifest that disagrees with its directory name
    assert find_latest(tmp_path, verify=True) == tmp_path / "step_10"
    assert find_latest(tmp_path / "absent") is None


def test_legacy_checkpoint_loads_with_a_warning_and_is_unverifiable(tmp_path, caplog):
    publish(tmp_path, 1)
    legacy = tmp_path / step_dir_name(2)
    (legacy / "policy").mkdir(parents=True)
    (legacy / "policy" / "mp_rank_00_model_states.pt").write_bytes(b"deepspeed")
    (legacy / "latest").write_text("global_step2")

    assert read_manifest(legacy) is None
    with caplog.at_level(logging.WARNING):
        assert find_latest(tmp_path) == legacy
        assert find_latest(tmp_path, verify=True) == legacy
    assert "legacy checkpoint" in caplog.text
    with pytest.raises(LegacyCheckpointError, match="cannot be verified"):
        verify_checkpoint(legacy)
    require_parts(legacy, ["policy"])
    with pytest.raises(CheckpointError, match="lacks the part.s. critic"):
        require_parts(legacy, ["policy", "critic"])


def test_require_parts_reads_the_manifest(tmp_path):
    checkpoint = publish(tmp_path, 1)
    require_parts(checkpoint, ["policy"])
    with pytest.raises(CheckpointError, match=r"lacks the part\(s\) critic, reference .*it has: \['policy'\]"):
        require_parts(checkpoint, ["policy", "critic", "reference"])
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        require_parts(tmp_path / "absent", ["policy"])


def test_names():
    assert step_dir_name(500) == "step_00000500" and step_dir_name(123456789) == "step_123456789"
    assert [parse_step_dir_name(name) for name in ("step_00000500", "step_7", "step_", "xstep_1", ".step_1")] == [
        500,
        7,
        None,
        None,
        None,
    ]
    name = staging_dir_name(3)
    assert name.startswith(".step_00000003.staging-") and parse_hidden_dir_name(name) == ("staging", 3)
    assert parse_hidden_dir_name(".step_00000003.retired-0a1b") == ("retired", 3)
    assert parse_hidden_dir_name("step_00000003") is None
    with pytest.raises(ValueError):
        step_dir_name(-1)
    assert [is_safe_relative_path(path) for path in ("a/b.pt", "a", "../a", "/a", "a//b", "a/./b", "a\\b", "")] == [
        True,
        True,
        False,
        False,
        False,
        False,
        False,
        False,
    ]


def test_listing_difference_names_the_rank():
    assert describe_listing_difference([["a", "b"], ["a", "b"]]) is None
    difference = describe_listing_difference([["a", "b"], ["a", "b"], ["a", "c"]])
    assert difference.startswith("rank 2 sees different files") and "missing ['b'], extra ['c']" in difference


def test_verify_cli(tmp_path, capsys):
    output_dir = tmp_path / "run"
    for step in (1, 2):
        publish(output_dir / "checkpoints", step)
    newest = output_dir / "checkpoints" / step_dir_name(2)

    assert verify_main([str(output_dir)]) == 0
    assert "2 valid, 0 invalid" in capsys.readouterr().out
    assert verify_main([str(output_dir / "checkpoints"), "--latest"]) == 0
    assert "1 valid" in capsys.readouterr().out
    flip_byte(newest / "policy" / "b.pt")
    assert verify_main([str(newest)]) == 1
    assert "wrong digest: policy/b.pt" in capsys.readouterr().out
    assert verify_main([str(newest), "--quick"]) == 0
    assert verify_main([str(tmp_path / "absent")]) == 2
    assert verify_main([str(tmp_path)]) == 2  # a folder without checkpoints
    legacy = output_dir / "checkpoints" / step_dir_name(3)
    (legacy / "policy").mkdir(parents=True)
    assert verify_main([str(legacy)]) == 3
    assert verify_main(["--no-such-flag"]) == 2


def run_verify(*arguments: str) -> subprocess.CompletedProcess:
    """`python -m astrai verify ARGUMENTS` as a user types it: the real dispatch in astrai/__main__.py."""
    return subprocess.run(
        [sys.executable, "-m", "astrai", "verify", *arguments],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_python_m_astrai_verify_in_a_subprocess(tmp_path):
    output_dir = tmp_path / "run"
    publish(output_dir / "checkpoints", 4)
    checkpoint = publish(output_dir / "checkpoints", 5, hash_algorithm="xxh3_128")

    valid = run_verify(str(output_dir))
    assert valid.returncode == 0, valid.stdout + valid.stderr
    assert f"OK       {checkpoint}: step 5, 3 files" in valid.stdout and "xxh3_128" in valid.stdout
    assert "sha256" in valid.stdout and "2 valid, 0 invalid, 0 legacy" in valid.stdout

    flip_byte(checkpoint / "policy" / "a.pt")
    damaged = run_verify(str(checkpoint))
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    assert (
        f"INVALID  {checkpoint}: wrong digest: policy/a.pt" in damaged.stdout and "0 valid, 1 invalid" in damaged.stdout
    )
    (checkpoint / "policy" / "a.pt").unlink()
    missing = run_verify(str(output_dir), "--latest")
    assert missing.returncode == 1 and "missing: policy/a.pt" in missing.stdout
    assert run_verify(str(tmp_path / "absent")).returncode == 2


def test_verify_cli_require_parts(tmp_path, capsys):
    """`--require-parts` fails a checkpoint lacking a part the job needs (what scripts/train.sh checks
    before a resume)."""
    output_dir = tmp_path / "run"
    publish(output_dir / "checkpoints", 1)
    newest = output_dir / "checkpoints" / step_dir_name(1)

    assert verify_main([str(output_dir), "--latest", "--quick", "--require-parts", "policy"]) == 0
    assert "1 valid, 0 invalid" in capsys.readouterr().out
    assert verify_main([str(newest), "--require-parts", "policy,critic"]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "lacks the part(s) critic" in out and "0 valid, 1 invalid" in out
    assert (
        verify_main([str(newest), "--require-parts", "policy", "--require-parts", " critic "]) == 1
    )  # repeatable, trimmed
    capsys.readouterr()
    legacy = output_dir / "checkpoints" / step_dir_name(2)
    (legacy / "policy").mkdir(parents=True)
    assert verify_main([str(legacy), "--require-parts", "policy"]) == 3  # parts present: still only "legacy"
    assert verify_main([str(legacy), "--require-parts", "policy,critic"]) == 1
    assert "INCOMPLETE" in capsys.readouterr().out
