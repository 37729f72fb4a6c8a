"""Write the reward-model pairs of the RLHF quickstart from the shipped arithmetic prompts (deterministic):
`python scripts/tools/make_reward_pairs.py`.

Each prompt of data/arithmetic/prompts.jsonl ({"prompt": "12+7=", "answer": "19"}) gives one pair: the right
answer chosen, a wrong one rejected (a near miss or a sign or digit slip, drawn with the seed). The first
`--heldout` prompts (which include the 64 of prompts_64.jsonl, the PPO prompts) go to the held-out file the
reward model never trains on; the rest to the training file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OFFSETS = (-10, -2, -1, 1, 2, 10)


def wrong_answer(right: int, rng: random.Random) -> int:
    """A plausible wrong answer: mostly near misses, sometimes the sign flipped (never the right one)."""
    if right != 0 and rng.random() < 0.15:
        return -right
    return right + rng.choice(OFFSETS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", default="data/arithmetic/prompts.jsonl")
    parser.add_argument("--out", default="data/arithmetic")
    parser.add_argument("--heldout", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    pairs = [
        {"prompt": row["prompt"], "chosen": row["answer"], "rejected": str(wrong_answer(int(row["answer"]), rng))}
        for row in rows
    ]
    out = Path(args.out)
    for name, part in (
        ("reward_pairs_heldout.jsonl", pairs[: args.heldout]),
        ("reward_pairs.jsonl", pairs[args.heldout :]),
    ):
        (out / name).write_text("".join(json.dumps(pair) + "\n" for pair in part))
        print(f"wrote {len(part)} pairs to {out / name}")


if __name__ == "__main__":
    main()
