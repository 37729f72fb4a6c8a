"""`train.logits_chunk_size` under DeepSpeed ZeRO-3 (one gloo rank, parameters partitioned): the tied
output layer is gathered by DeepSpeed's module hooks around the chunked computation, and sft and grpo
(policy loss, behaviour and reference log-probs, entropy) train to the same losses and weights with
chunking on as off."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.algos.chunked_logprobs import head_statistics
from astrai.config import load_job
from astrai.models import output_head
from astrai.training.build import build_run
from astrai.training.loops import train_offline, train_online
from tests.conftest import REPO

RUN = """\
output_dir: {output_dir}
model:
  init: {{model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32}}
rollout: {{prompts_per_step: 4, group_size: 2, max_new_tokens: 6, behaviour_logprobs: recompute}}
reward: {{function: "tests.unit.strategies.test_ppo_engines:digit_count"}}
rl: {{kl_coef: 0.05, epochs_per_rollout: 2}}
train: {{train_type: {train_type}, max_steps: 2, micro_batch_size: 4, lr: 1e-2, warmup_steps: 0, seed: 5,
         logits_chunk_size: {chunk_size}}}
deepspeed: {{zero_stage: 3}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def trained(one_rank, folder, train_type: str, data: str, chunk_size: int):
    lines = (REPO / f"data/arithmetic/{data}").read_text().splitlines(keepends=True)[:16]
    (folder / data).write_text("".join(lines))
    config = folder / f"job_{chunk_size}.yaml"
    output_dir = folder / f"out_{chunk_size}"
    config.write_text(
        RUN.format(output_dir=output_dir, data=folder / data, train_type=train_type, chunk_size=chunk_size)
    )
    run = build_run(load_job(config), one_rank, str(config))
    (train_offline if train_type == "sft" else train_online)(run)
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    policy = run.engines["policy"]
    with policy.gathered_parameters():
        weights = {name: p.detach().clone() for name, p in policy.module.named_parameters()}
    return records, weights


@pytest.mark.parametrize(("train_type", "data"), [("sft", "sft.jsonl"), ("grpo", "prompts.jsonl")])
def test_zero3_trains_the_same_with_chunked_logits(one_rank, tmp_path, monkeypatch, train_type, data):
    full_records, full_weights = trained(one_rank, tmp_path, train_type, data, 0)
    calls = []  # the chunked path really runs (a spy that calls through)
    monkeypatch.setattr(output_head, "head_statistics", lambda *a, **k: calls.append(1) or head_statistics(*a, **k))
    chunked_records, chunked_weights = trained(one_rank, tmp_path, train_type, data, 8)
    assert calls
    keys = ["loss"] + (["entropy", "kl"] if train_type == "grpo" else [])
    for full, chunked in zip(full_records, chunked_records, strict=True):
        for key in keys:
            assert chunked[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), key
    for name, weight in full_weights.items():
        torch.testing.assert_close(chunked_weights[name], weight, rtol=1e-5, atol=1e-6, msg=name)
