"""scripts/gpu_check.sh --cpu: the GPU check's whole sequence (every phase, the report, the optimizer fallback, the
long-context phase) at a tiny shape on the CPU, in bf16 as on a GPU (DeepSpeed's bf16 engine, its checkpoints,
resume, export, bf16 rollouts; autocast in the plain loop), so that no line of it meets a GPU unrun: only the device
choice differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_gpu_check_cpu_mode_runs_every_phase_and_reports(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    # An optimizer the job refuses: the sft phase must say so and finish with torch's AdamW, the path the GPU
    # check takes when DeepSpeed's fused Adam cannot be built there.
    command = ["bash", "scripts/gpu_check.sh", "--cpu", "--precision", "bf16", "--optimizer", "no_such_adam"]
    command += ["--work", str(tmp_path / "w")]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

    files = sorted(path.name for path in out.iterdir())
    # Exactly these: the device tool returns at most 8 files, so a phase that adds one must say so here.
    assert files == [
        "console.log", "env.txt", "gpu_check.json", "gpu_check.md", "gpu_check_logs.txt",
        "long_context_gpu.json", "long_context_gpu.md",
    ]  # fmt: skip
    assert "deepspeed" in (out / "env.txt").read_text()
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["args"]["precision"] == "bf16"
    assert "ZeRO-0, bf16" in (tmp_path / "w" / "sft_sdpa.log").read_text()  # DeepSpeed's bf16 engine trained
    rows = {row["phase"]: row for row in results["rows"]}
    assert list(rows) == [
        "peak", "nccl", "sft_sdpa", "plain_sdpa", "resume", "export", "grpo", "online_ppo", "sft_flash", "plain_flash"
    ]  # fmt: skip

    assert rows["peak"]["peak_tflops"] > 0
    assert rows["nccl"]["backend"] == "gloo" and rows["nccl"]["all_reduce_ok"] is True
    sft, plain = rows["sft_sdpa"], rows["plain_sdpa"]
    assert sft["exit"] == 0 and "no_such_adam failed (exit 2)" in sft["note"]
    assert sft["steps"] == 6 and sft["tokens_per_s"] > 0 and 0 < sft["mfu"] < 1
    assert sft["publish_mib"] > 0
    assert plain["exit"] == 0 and plain["tokens_per_s"] > 0 and 0 < plain["mfu"] < 1
    assert rows["sft_flash"]["exit"] is None and "no GPU" in rows["sft_flash"]["note"]
    assert rows["resume"]["exit"] == 0 and rows["resume"]["steps_logged"] == [7, 8]
    assert rows["export"]["exit"] == 0 and rows["export"]["exported_parameters"] > 0
    for phase in ("grpo", "online_ppo"):
        assert rows[phase]["exit"] == 0 and rows[phase]["steps"] == 3 and rows[phase]["step_s"] > 0

    table = (out / "gpu_check.md").read_text()
    assert "| sft_sdpa |" in table and "vs plain PyTorch" in table and "gloo all_reduce ok" in table

    # The long-context phase: the planner's longest packed row for the (pretend, --cpu) device, trained 2 steps.
    long_context = json.loads((out / "long_context_gpu.json").read_text())
    assert long_context["planned_longest"] > 0 and long_context["rows"][0]["length"] == long_context["planned_longest"]
    assert long_context["rows"][-1]["exit"] == 0 and long_context["rows"][-1]["steps"] == 2
    assert long_context["rows"][-1]["measured_gib"] > 0 and long_context["rows"][-1]["planned_gib"] > 0
    assert "long_context" in (out / "console.log").read_text()
