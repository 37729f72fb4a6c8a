"""Padding-free packing against right-padded micro-batches: real (non-pad) tokens per second of `sft` on a chat set
whose lengths follow a long tail, and the peak RSS of each, in one run of the real trainer (`astrai/train.py`
under the deepspeed launcher; the same model, data, seed and optimizer both ways).

The data set is generated here: N chats whose assistant answers have log-normal lengths (median ~150
characters, sigma 1.1), cut to 20-2,000; the char tokenizer makes a character a token, so rows run from
about 30 to 2,000 tokens, most of them short. `padded` takes `--micro-batch` rows per micro-batch, right-padded
to the longest; `packed` (data.packing) concatenates rows up to `--tokens` per micro-batch. Both count the same
real tokens (the metric `tokens`, attended tokens); the figure is real tokens / step seconds over the steps
after `--warmup`.

    python benchmarks/packing.py --ranks 1 --steps 12
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    add_launch_arguments,
    child_env,
    command_line,
    deepspeed_command,
    fresh_workspace,
    launch,
    machine_line,
    markdown_table,
    summarize,
    write_results,
)

WORDS = "the of and to in is was for on that with as by at from this be are or an it not which".split()


def chat_rows(count: int, seed: int) -> list[dict]:
    """Chats with long-tailed answer lengths (characters = tokens under the char tokenizer), 20-2,000."""
    generator = random.Random(seed)
    rows = []
    for _ in range(count):
        length = min(2000, max(20, round(math.exp(generator.gauss(math.log(150), 1.1)))))
        answer = ""
        while len(answer) < length:
            answer += generator.choice(WORDS) + " "
        question = " ".join(generator.choice(WORDS) for _ in range(generator.randint(3, 12)))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer[:length].strip()},
                ]
            }
        )
    return rows


def job_text(work: Path, name: str, args, packing: bool) -> str:
    batch = (
        f"micro_batch_tokens: {args.tokens}, micro_batch_size: 1"
        if packing
        else f"micro_batch_size: {args.micro_batch}"
    )
    return f"""\
output_dir: {work / name}
model:
  init: {{model_type: llama, hidden_size: {args.hidden}, intermediate_size: {4 * args.hidden},
          num_hidden_layers: {args.layers}, num_attention_heads: 4, num_key_value_heads: 4,
          max_position_embeddings: 2304, tie_word_embeddings: false}}
  dtype: fp32
  attn_implementation: sdpa
tokenizer: {{build: {{kind: char}}}}
data: {{path: {work / "chats.jsonl"}, max_seq_len: 2048, packing: {str(packing).lower()}}}
train: {{train_type: sft, max_steps: {args.steps}, {batch}, grad_accum_steps: 1, lr: 1e-3, lr_schedule: constant,
         warmup_steps: 0, seed: 7}}
deepspeed: {{zero_stage: 0}}
checkpoint: {{every_steps: 100000}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def run_variant(work: Path, name: str, args, packing: bool) -> dict:
    config = work / f"{name}.yaml"
    config.write_text(job_text(work, name, args, packing))
    command = deepspeed_command(args.ranks, REPO / "astrai/train.py", "--config", str(config))
    result = launch(command, env=child_env(OMP_NUM_THREADS=str(args.threads)), timeout=args.timeout)
    (work / f"{name}.log").write_text(result.text())
    if result.returncode != 0:
        raise SystemExit(f"{name} failed ({result.returncode}); see {work / name}.log:\n{result.text()[-3000:]}")
    records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > args.warmup]
    seconds = [r["tokens"] / r["tokens_per_s"] for r in timed]
    return {
        "variant": name,
        "steps": len(timed),
        "rows": timed[-1]["samples"] - (records[args.warmup - 1]["samples"] if args.warmup else 0),
        "real_tokens": sum(r["tokens"] for r in timed),
        "seconds": sum(seconds),
        "real_tokens_per_s": sum(r["tokens"] for r in timed) / sum(seconds),
        "step_tokens_per_s": summarize([r["tokens_per_s"] for r in timed]),
        "peak_rss_mib": max(result.peak_rss_mib.values()) if result.peak_rss_mib else None,
        "wall_s": result.wall_s,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_arguments(parser, "packing")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4, help="padded: rows per micro-batch")
    parser.add_argument("--tokens", type=int, default=4096, help="packed: train.micro_batch_tokens")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    rows = chat_rows(args.rows, seed=0)
    (work / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    lengths = sorted(len(row["messages"][1]["content"]) for row in rows)
    runs = [run_variant(work, "padded", args, False), run_variant(work, "packed", args, True)]
    padded, packed = runs
    ratio = packed["real_tokens_per_s"] / padded["real_tokens_per_s"]
    payload = {
        "machine": info,
        "command": command_line(),
        "answer_chars": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]},
        "runs": runs,
        "packed_over_padded": ratio,
    }
    table = markdown_table(
        ["variant", "ranks", "steps timed", "rows", "real tokens", "real tokens/s", "peak RSS per rank (MiB)"],
        [
            [
                run["variant"],
                args.ranks,
                run["steps"],
                run["rows"],
                run["real_tokens"],
                f"{run['real_tokens_per_s']:.0f}",
                f"{run['peak_rss_mib']:.0f}" if run["peak_rss_mib"] else "-",
            ]
            for run in runs
        ],
    )
    markdown = (
        f"{table}\n\npacked / padded real tokens/s: **{ratio:.2f}x** "
        f"(answer lengths {lengths[0]}-{lengths[-1]} tokens, median {lengths[len(lengths) // 2]}).\n\n"
        f"{machine_line(info)}\n\nCommand: `{command_line()}`"
    )
    write_results(args.name, payload, markdown, results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
