"""Helpers to write tiny job files and launch `run_plan.py` on real DeepSpeed ranks."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import REPO, launch_ranks

TINY_JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}}
tokenizer:
  build: {{kind: char}}
data:
  path: {data}
  max_seq_len: 32
train:
  train_type: {train_type}
  max_steps: 12
  micro_batch_size: 4
  grad_accum_steps: 1
  lr: 5e-3
  lr_schedule: constant
  warmup_steps: 0
  seed: 7
deepspeed:
  zero_stage: 2
runtime:
  progress_bar: false
  tensorboard: false
"""

DATA = {
    "sft": REPO / "data/arithmetic/sft.jsonl",
    "seq": REPO / "data/arithmetic/text.jsonl",
    "dpo": REPO / "data/arithmetic/preference.jsonl",
    "rm": REPO / "data/arithmetic/preference.jsonl",
}


def write_job(folder: Path, name: str, train_type: str = "sft") -> str:
    path = folder / f"{name}.yaml"
    path.write_text(TINY_JOB.format(output_dir=folder / name, data=DATA[train_type], train_type=train_type))
    return str(path)


ARITHMETIC_SFT_JOB = """\
output_dir: {folder}/sft
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}}
tokenizer:
  build: {{kind: char}}
data: {{path: {folder}/sft.jsonl, max_seq_len: 32}}
train: {{train_type: sft, max_steps: 120, micro_batch_size: 8, lr: 5e-3, lr_schedule: constant, warmup_steps: 0,
         seed: 7}}
deepspeed: {{zero_stage: 2}}
runtime: {{progress_bar: false, tensorboard: false}}
export: {{hf_dir: {folder}/sft_hf, on_finish: true}}
"""


def arithmetic_sft_run(folder: Path, rows: int = 32) -> dict:
    """The RL tests' starting point: `rows` shipped arithmetic chats for a short SFT exported to
    `<folder>/sft_hf`, and `<folder>/prompts.jsonl` whose row i asks the question of chat i.
    Returns the plan entry of the SFT run (put it first in the launch)."""
    lines = (REPO / "data/arithmetic/sft.jsonl").read_text().splitlines(keepends=True)[:rows]
    (folder / "sft.jsonl").write_text("".join(lines))
    prompts = (REPO / "data/arithmetic/prompts.jsonl").read_text().splitlines(keepends=True)[:rows]
    (folder / "prompts.jsonl").write_text("".join(prompts))
    (folder / "sft.yaml").write_text(ARITHMETIC_SFT_JOB.format(folder=folder))
    return {"name": "sft", "config": str(folder / "sft.yaml")}


def launch_plan(folder: Path, runs: list[dict], ranks: int = 2, timeout: int = 900) -> dict:
    """Run every job of `runs` in one launch of `ranks` ranks; returns rank 0's results."""
    plan = folder / "plan.json"
    results = folder / "results.json"
    plan.write_text(json.dumps({"results": str(results), "runs": runs}))
    completed = launch_ranks([REPO / "tests/integration/run_plan.py", "--plan", plan], ranks, timeout)
    (folder / "launch.log").write_text(completed.stdout + completed.stderr)
    assert completed.returncode == 0, (
        f"launch failed ({completed.returncode}):\n{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}"
    )
    return json.loads(results.read_text())


def metrics(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]
