"""scripts/tools/make_reward_pairs.py: the three shipped pair files are what it writes (deterministic), and
`--every-wrong-answer` adds every wrong answer of each training row (prompts.jsonl repeats some prompts, and
some held-out prompts recur among the training rows: docs/guides/reward-models.md measures accuracy on both kinds)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

from tests.conftest import REPO

SCRIPT = REPO / "scripts/tools/make_reward_pairs.py"


def test_shipped_pairs_are_reproduced_and_every_wrong_answer_is_added(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--every-wrong-answer"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    for name in ("reward_pairs.jsonl", "reward_pairs_heldout.jsonl", "reward_pairs_all.jsonl"):
        assert (tmp_path / name).read_bytes() == (REPO / "data/arithmetic" / name).read_bytes(), name
    prompts = [json.loads(line) for line in (REPO / "data/arithmetic/prompts.jsonl").read_text().splitlines()]
    training = prompts[400:]
    pairs = [json.loads(line) for line in (tmp_path / "reward_pairs_all.jsonl").read_text().splitlines()]
    answers = {row["prompt"]: row["answer"] for row in training}
    rows_of = Counter(row["prompt"] for row in training)
    per_prompt = Counter(pair["prompt"] for pair in pairs)
    assert per_prompt.keys() == answers.keys()
    for prompt, count in per_prompt.items():  # six near misses and the sign flip, for each row of the prompt
        assert count == rows_of[prompt] * (6 if answers[prompt] == "0" else 7), prompt
    assert all(pair["chosen"] == answers[pair["prompt"]] != pair["rejected"] for pair in pairs)
    rejected = {prompt: set() for prompt in answers}
    for pair in pairs:
        rejected[pair["prompt"]].add(int(pair["rejected"]))
    for prompt, wrong in rejected.items():  # every near miss and the sign flip (the two coincide for 1 and 5)
        right = int(answers[prompt])
        assert wrong == {right + offset for offset in (-10, -2, -1, 1, 2, 10)} | ({-right} if right else set())
