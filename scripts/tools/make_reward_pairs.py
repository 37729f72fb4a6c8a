"""Write the reward-model pairs of the RLHF quickstart from the shipped arithmetic prompts (deterministic):
`python scripts/tools/make_reward_pairs.py`.

Each prompt of data/arithmetic/prompts.jsonl ({"prompt": "12+7=", "answer": "19"}) gives one pair: the right
answer chosen, a wrong one rejected (a near miss or a sign or digit slip, drawn with the seed). The first
`--heldout` prompts (which include the 64 of prompts_64.jsonl, the PPO prompts) go to the held-out file the
reward model never trains on; the rest to the training file.

`--every-wrong-answer` also writes reward_pairs_all.jsonl: each training prompt with every wrong answer of
`wrong_answers` (the six near misses, and the sign flip unless the answer is 0), shuffled with the seed. A
reward model needs those comparisons to tell the units digit (docs/guides/reward-models.md, "Reward model"); InstructGPT
trains on all of a prompt's comparisons too. The two files above are the same with or without it.
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


def wrong_answers(right: int) -> list[int]:
    """Every wrong answer `wrong_answer` can draw for `right`."""
    return [right + offset for offset in OFFSETS] + ([-right] if right != 0 else [])


def every_pair(rows: list[dict], seed: int) -> list[dict]:
    pairs = [
        {"prompt": row["prompt"], "chosen": row["answer"], "rejected": str(wrong)}
        for row in rows
        for wrong in wrong_answers(int(row["answer"]))
    ]
    random.Random(seed).shuffle(pairs)
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", default="data/arithmetic/prompts.jsonl")
    parser.add_argument("--out", default="data/arithmetic")
    parser.add_argument("--heldout", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--every-wrong-answer", action="store_true", help="also write reward_pairs_all.jsonl")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    pairs = [
        {"prompt": row["prompt"], "chosen": row["answer"], "rejected": str(wrong_answer(int(row["answer"]), rng))}
        for row in rows
    ]
    out = Path(args.out)
    files = [("reward_pairs_heldout.jsonl", pairs[: args.heldout]), ("reward_pairs.jsonl", pairs[args.heldout :])]
    if args.every_wrong_answer:
        files.append(("reward_pairs_all.jsonl", every_pair(rows[args.heldout :], args.seed)))
    for name, part in files:
        (out / name).write_text("".join(json.dumps(pair) + "\n" for pair in part))
        print(f"wrote {len(part)} pairs to {out / name}")


if __name__ == "__main__":
    main()
