"""Smoke test of benchmarks/rollout_prefill.py (a benchmark, not a test of its numbers): it runs on a tiny
model in-process and writes its JSON + Markdown, and its shared and unshared rollouts sample the same tokens."""

from __future__ import annotations

import json

from benchmarks.rollout_prefill import main


def test_rollout_prefill_smoke(tmp_path):
    args = ["--size", "tiny", "--new-tokens", "4", "--prompt-lens", "8", "--repeats", "1", "--prompts", "2"]
    assert main([*args, "--group-size", "3", "--results-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "rollout_prefill.json").read_text())
    assert (tmp_path / "rollout_prefill.md").read_text().strip()
    assert result["summary"]["rollout_shared (prompt 8)"]["median"] > 0
    assert result["identical_tokens"] == {"8": [True]}
