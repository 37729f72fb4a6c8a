"""Smoke tests of benchmarks/grpo_vs_trl.py (a benchmark, not a test of its numbers). TRL is never needed here:
the dry run builds and validates the AstrAI jobs, and the launching smoke runs the AstrAI variants only."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from tests.conftest import REPO, child_env, run_bounded

SCRIPT = REPO / "benchmarks" / "grpo_vs_trl.py"


def test_grpo_vs_trl_dry_run_builds_valid_jobs_without_trl(tmp_path):
    command = [sys.executable, str(SCRIPT), "--dry-run", "--size", "tiny", "--results-dir", str(tmp_path)]
    completed = run_bounded(command, 120, cwd=REPO, env=child_env())
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    jobs = tmp_path / "grpo_vs_trl_work" / "jobs"
    shared, unshared = (yaml.safe_load((jobs / f"{name}.yaml").read_text()) for name in ("astrai", "astrai_unshared"))
    assert shared["rollout"]["share_prefill"] is True and unshared["rollout"]["share_prefill"] is False
    prefix = yaml.safe_load((jobs / "astrai_prefix.yaml").read_text())
    assert prefix["rl"]["share_prefix"] is True and shared["rl"]["share_prefix"] is False
    assert shared["reward"]["function"] == "astrai.rollout.rewards:arithmetic_exact_match"
    # one optimizer step per rollout: prompts x group = micro-batch x accumulation
    rollout, train = shared["rollout"], shared["train"]
    assert rollout["prompts_per_step"] * rollout["group_size"] == train["micro_batch_size"] * train["grad_accum_steps"]
    tokenizer = json.loads((tmp_path / "grpo_vs_trl_work" / "tokenizer" / "tokenizer.json").read_text())
    assert shared["model"]["init"]["vocab_size"] >= len(tokenizer["model"]["vocab"])
    assert not (tmp_path / "grpo_vs_trl.json").exists()  # a dry run launches and records nothing


@pytest.mark.slow
def test_grpo_vs_trl_smoke_astrai_variants(tmp_path):
    arguments = ["--size", "tiny", "--steps", "2", "--warmup", "1", "--rounds", "1", "--new-tokens", "2"]
    command = [sys.executable, str(SCRIPT), *arguments, "--variants", "astrai_prefix,astrai"]
    completed = run_bounded([*command, "--results-dir", str(tmp_path)], 300, cwd=REPO, env=child_env())
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "grpo_vs_trl.json").read_text())
    assert (tmp_path / "grpo_vs_trl.md").read_text().strip()
    assert [run["variant"] for run in result["runs"]] == ["astrai_prefix", "astrai"]  # rl.share_prefix runs too
    assert all(run["best_step_s"] <= run["step_s"] and len(run["step_seconds"]) == 2 for run in result["runs"])
    assert [(r["variant"], r["baseline"], r["of"]) for r in result["ratios"]] == [
        ("astrai_prefix", "astrai", "step_s"),
        ("astrai_prefix", "astrai", "best_step_s"),
    ]


@pytest.mark.slow
def test_profile_grpo_step_smoke_splits_the_whole_loop(tmp_path):
    """benchmarks/profile_grpo_step.py on the tiny model: every part of the loop is found, none is negative,
    and the parts add up to the profiled loop."""
    script = REPO / "benchmarks" / "profile_grpo_step.py"
    arguments = ["--size", "tiny", "--steps", "2", "--new-tokens", "2", "--results-dir", str(tmp_path)]
    completed = run_bounded([sys.executable, str(script), *arguments], 300, cwd=REPO, env=child_env())
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "profile_grpo_step.json").read_text())
    parts = result["parts"]
    assert sum(part["share"] for part in parts.values()) == pytest.approx(1.0)
    assert all(part["s"] >= -1e-3 for part in parts.values()), parts
    for measured in ("rollout: generate (prefill + decode steps)", "reference forward", "policy backward"):
        assert parts[measured]["s"] > 0, measured
    assert parts["rollout: behaviour log-probs"]["s"] == 0  # one update per rollout: no behaviour forward
    assert (tmp_path / "profile_grpo_step_work" / "profile.pstats").stat().st_size > 0
