"""Pair accuracy of a reward model on a pairs file:

    python scripts/tools/reward_accuracy.py runs/rm/hf data/arithmetic/reward_pairs_heldout.jsonl

Scores every pair's chosen and rejected answer with the folder exactly as online_ppo's `reward.model_path`
does (astrai.rollout.rewards.ModelReward: the folder's own tokenizer and chat template, fp32) and prints one
JSON line: pairs, accuracy (chosen scored strictly higher), mean margin, mean chosen and rejected reward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch

    from astrai.rollout.rewards import ModelReward

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", help="an rm export (or any AutoModelForSequenceClassification folder, one output)")
    parser.add_argument("pairs", help="JSON lines {prompt, chosen, rejected}")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    rows = [json.loads(line) for line in Path(args.pairs).read_text().splitlines() if line.strip()]
    reward = ModelReward(args.model, torch.device("cpu"), args.batch_size)
    messages = [[{"role": "user", "content": row["prompt"]}] for row in rows]
    prompts = [row["prompt"] for row in rows]
    chosen = reward({"messages": messages, "prompts": prompts, "responses": [row["chosen"] for row in rows]})
    rejected = reward({"messages": messages, "prompts": prompts, "responses": [row["rejected"] for row in rows]})
    report = {
        "pairs": len(rows),
        "accuracy": round(float((chosen > rejected).float().mean()), 4),
        "margin": round(float((chosen - rejected).mean()), 4),
        "chosen_reward": round(float(chosen.mean()), 4),
        "rejected_reward": round(float(rejected.mean()), 4),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
