"""Write the shipped arithmetic data sets (deterministic for the seed): `python scripts/tools/make_arithmetic.py`.

A task whose answers are checkable ("12+7=" -> "19") serves every train type: SFT chats, packed
text for pre-training, preference pairs for DPO (correct answer chosen, a near miss rejected) and
prompts with a verifiable reward for GRPO/PPO.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def problems(count: int, rng: random.Random, largest: int) -> list[tuple[int, int, str]]:
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, largest), rng.randint(0, largest)
        operator = rng.choice("+-")
        if operator == "-" and b > a:
            a, b = b, a
        rows.append((a, b, operator))
    return rows


def answer(a: int, b: int, operator: str) -> int:
    return a + b if operator == "+" else a - b


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="data/arithmetic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--largest", type=int, default=49)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = problems(args.count, rng, args.largest)
    chats, texts, pairs, prompts = [], [], [], []
    for a, b, operator in rows:
        question, result = f"{a}{operator}{b}=", answer(a, b, operator)
        chats.append(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": str(result)}]}
        )
        texts.append({"text": f"{question}{result}"})
        wrong = result + rng.choice([-10, -2, -1, 1, 2, 10])
        pairs.append({"prompt": question, "chosen": str(result), "rejected": str(wrong)})
        prompts.append({"prompt": question, "answer": str(result)})
    write_jsonl(out / "sft.jsonl", chats)
    write_jsonl(out / "text.jsonl", texts)
    write_jsonl(out / "preference.jsonl", pairs)
    write_jsonl(out / "prompts.jsonl", prompts)
    # The PPO quickstart's prompts: few enough that a CPU run of minutes can learn their answers (and
    # its critic their values), while the SFT model answers about 1 in 8 of them at the start.
    write_jsonl(out / "prompts_64.jsonl", prompts[:64])
    print(f"wrote {len(rows)} rows of each kind to {out}")


if __name__ == "__main__":
    main()
