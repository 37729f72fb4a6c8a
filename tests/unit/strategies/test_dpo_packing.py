"""`dpo.precompute_reference` with `data.packing`: the reference log-probs computed once over packed micro-batches
equal those of padded ones (one DeepSpeed rank in this process, the real build)."""

from __future__ import annotations

import pytest

from astrai.config import load_job
from astrai.strategies.dpo import REFERENCE_COLUMNS
from astrai.training.build import build_run
from tests.conftest import REPO

JOB = """\
output_dir: {folder}/out_{name}
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 128, tie_word_embeddings: true}}
  dtype: fp32
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 64}}
train: {{train_type: dpo, max_steps: 1, micro_batch_size: 3, micro_batch_tokens: 512, seed: 7}}
dpo: {{precompute_reference: true}}
deepspeed: {{zero_stage: 0}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def test_precomputed_reference_logprobs_packed_equal_padded(one_rank, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join((REPO / "data/arithmetic/preference.jsonl").read_text().splitlines(keepends=True)[:10]))
    columns = {}
    for name, packing in (("padded", "false"), ("packed", "true")):
        config = tmp_path / f"{name}.yaml"
        config.write_text(JOB.format(folder=tmp_path, name=name, data=data))
        run = build_run(load_job(config, [f"data.packing={packing}"]), one_rank, str(config))
        columns[name] = [run.dataset[column] for column in REFERENCE_COLUMNS]
    for padded, packed in zip(columns["padded"], columns["packed"]):
        assert len(packed) == 10 and packed == pytest.approx(padded, abs=1e-5)
