"""`rm.share_prefix` against the plain reward-model forward: seconds per step of `rm` in the real trainer
(`astrai/train.py` under the deepspeed launcher), the same model, pairs, seed and optimizer both ways,
alternated run by run.

Two data sets:
    arithmetic  the RLHF quickstart's shipped every-wrong-answer pairs (data/arithmetic/reward_pairs_all.jsonl;
                25-token prompts, 3-4-token completions) on the quickstart's model shape (hidden 96, 3 layers)
    long        generated pairs: prompts of `--prompt-chars` characters (one char tokenizer token each),
                completions of `--completion-chars`, on a 2-layer Llama of hidden size 128: the shape of
                preference data with long prompts and short answers

Figure: the median step time over the steps after `--warmup` (metrics.jsonl's elapsed_s), and shared / plain.

    python benchmarks/rm_share_prefix.py                    # both data sets, 40 steps each variant, 2 rounds
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    add_launch_arguments,
    busy_fraction,
    child_env,
    command_line,
    deepspeed_command,
    fresh_workspace,
    launch,
    machine_line,
    markdown_table,
    write_results,
)

ARITHMETIC_PAIRS = REPO / "data/arithmetic/reward_pairs_all.jsonl"
WORDS = "the of and to in is was for on that with as by at from this be are or an it not which".split()
SHAPES = {
    "arithmetic": {"hidden": 96, "intermediate": 256, "layers": 3, "heads": 4, "kv_heads": 2},
    "long": {"hidden": 128, "intermediate": 512, "layers": 2, "heads": 4, "kv_heads": 4},
}


def text_of(length: int, generator: random.Random) -> str:
    text = ""
    while len(text) < length:
        text += generator.choice(WORDS) + " "
    return text[:length].strip()


def long_pairs(count: int, prompt_chars: int, completion_chars: int, seed: int = 0) -> list[dict]:
    generator = random.Random(seed)
    return [
        {
            "prompt": text_of(prompt_chars, generator),
            "chosen": text_of(completion_chars, generator),
            "rejected": text_of(completion_chars, generator),
        }
        for _ in range(count)
    ]


def job_text(work: Path, name: str, data: Path, shape: dict, args, shared: bool, max_len: int) -> str:
    return f"""\
output_dir: {work / name}
model:
  init: {{model_type: llama, hidden_size: {shape["hidden"]}, intermediate_size: {shape["intermediate"]},
          num_hidden_layers: {shape["layers"]}, num_attention_heads: {shape["heads"]},
          num_key_value_heads: {shape["kv_heads"]}, max_position_embeddings: {max_len}, tie_word_embeddings: true}}
  dtype: fp32
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: {max_len}}}
rm: {{share_prefix: {str(shared).lower()}}}
train: {{train_type: rm, max_steps: {args.steps}, micro_batch_size: {args.micro_batch}, grad_accum_steps: 1, lr: 5e-4,
         lr_schedule: constant, warmup_steps: 0, seed: 7}}
deepspeed: {{zero_stage: 0}}
checkpoint: {{every_steps: 100000}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def run_variant(work: Path, name: str, text: str, args) -> dict:
    config = work / f"{name}.yaml"
    config.write_text(text)
    busy = busy_fraction()
    command = deepspeed_command(1, REPO / "astrai/train.py", "--config", str(config))
    result = launch(command, env=child_env(OMP_NUM_THREADS=str(args.threads)), timeout=args.timeout)
    (work / f"{name}.log").write_text(result.text())
    if result.returncode != 0:
        raise SystemExit(f"{name} failed ({result.returncode}); see {work / name}.log:\n{result.text()[-3000:]}")
    records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    elapsed = [record["elapsed_s"] for record in records]
    steps = [after - before for before, after in zip(elapsed[args.warmup - 1 :], elapsed[args.warmup :])]
    return {"variant": name, "steps_timed": len(steps), "step_s": statistics.median(steps), "busy_before": busy}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_arguments(parser, "rm_share_prefix")
    parser.add_argument("--data", nargs="+", default=["arithmetic", "long"], choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="plain, shared alternated this many times")
    parser.add_argument("--micro-batch", type=int, default=128, help="pairs per step (long: use fewer)")
    parser.add_argument("--long-micro-batch", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=256, help="long: generated pairs")
    parser.add_argument("--prompt-chars", type=int, default=256)
    parser.add_argument("--completion-chars", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of the one rank")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    results_dir, work, info = fresh_workspace(args.results_dir, args.name)
    rows, cases = [], {}
    for data in args.data:
        if data == "arithmetic":
            path, max_len, micro = ARITHMETIC_PAIRS, 64, args.micro_batch
        else:
            path = work / "long_pairs.jsonl"
            pairs = long_pairs(args.pairs, args.prompt_chars, args.completion_chars)
            path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
            max_len, micro = args.prompt_chars + args.completion_chars + 64, args.long_micro_batch
        case_args = argparse.Namespace(**{**vars(args), "micro_batch": micro})
        runs = {"plain": [], "shared": []}
        for round_index in range(args.rounds):
            for shared in (False, True):
                name = f"{data}_{'shared' if shared else 'plain'}_{round_index}"
                text = job_text(work, name, path, SHAPES[data], case_args, shared, max_len)
                runs["shared" if shared else "plain"].append(run_variant(work, name, text, case_args))
        plain = statistics.median(run["step_s"] for run in runs["plain"])
        shared = statistics.median(run["step_s"] for run in runs["shared"])
        cases[data] = {"plain_step_s": plain, "shared_step_s": shared, "speedup": plain / shared, "runs": runs}
        rows.append([data, micro, f"{plain:.4f}", f"{shared:.4f}", f"**{plain / shared:.2f}x**"])
    payload = {"machine": info, "command": command_line(), "cases": cases}
    table = markdown_table(["data", "pairs per step", "plain s/step", "share_prefix s/step", "plain / shared"], rows)
    markdown = f"{table}\n\n{machine_line(info)}\n\nCommand: `{command_line()}`"
    write_results(args.name, payload, markdown, results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
