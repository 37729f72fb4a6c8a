"""The README's main job, launched as a user would: `deepspeed astrai/train.py --config configs/quickstart.yaml`."""

from __future__ import annotations

import json

import pytest
import yaml

from astrai.checkpoint import verify_checkpoint
from tests.conftest import launch_ranks, user_env

pytestmark = pytest.mark.slow


def test_quickstart_job_runs_through_the_real_launcher(tmp_path):
    output = tmp_path / "quickstart"
    arguments = [
        "astrai/train.py",
        "--config",
        "configs/quickstart.yaml",
        "--set",
        "train.max_steps=40",
        "--set",
        f"output_dir={output}",
        "--set",
        f"export.hf_dir={output / 'hf'}",
        "--set",
        "checkpoint.every_steps=10",  # 4 publishes: the job's keep_last: 2 retires two of them
    ]
    network_log = tmp_path / "network.log"  # launched from a user's environment: nothing may leave the machine
    result = launch_ranks(arguments, ranks=1, timeout=600, env=user_env(network_log))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        len(network_log.with_name("network.log.pids").read_text().split()) >= 3
    )  # the spy watched launcher, launch.py and rank
    assert not network_log.exists(), network_log.read_text()
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    for field in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"):
        assert all(field in r for r in records), field
    assert all(r["grad_norm"] > 0 for r in records)  # 1 rank runs ZeRO-0, whose norm DeepSpeed itself drops
    assert sum(r["loss"] for r in records[-5:]) / 5 < 0.6 * records[0]["loss"]  # learned something visible
    assert (output / "job.yaml").is_file() and (output / "tokenizer" / "tokenizer.json").is_file()
    published = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert published == ["step_00000030", "step_00000040"]  # retention kept the newest 2, left nothing hidden
    assert verify_checkpoint(output / "checkpoints" / "step_00000040").step == 40
    assert (output / "hf" / "model.safetensors").is_file() and (output / "hf" / "config.json").is_file()
    assert "[rank0]" in result.stdout + result.stderr  # logs carry the rank
    assert "intra-op threads per rank:" in result.stderr  # the thread pinning says what it chose
    assert "host malloc: blocks up to 32 MiB from the heap" in result.stderr  # runtime.tune_malloc, on by default
    assert "train: 100%" in result.stderr and "40/40" in result.stderr  # rank 0's progress bar ran to the end
    resolved = yaml.safe_load((output / "job.yaml").read_text())  # the job as run, overrides applied
    assert resolved["output_dir"] == str(output) and resolved["train"]["max_steps"] == 40
    assert resolved["checkpoint"]["every_steps"] == 10 and resolved["checkpoint"]["hash"] == "sha256"
