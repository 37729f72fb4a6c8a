"""Packing on 2 real gloo ranks, in ONE launch (tests/integration/packing_rank_worker.py): for seq (document
mask), sft, dpo, grpo and online_ppo, the loss and the rank-averaged gradients of the packed micro-batches equal
the padded run of the same rows within 1e-5 (fp32), the frozen targets (reference log-probs, values, advantages)
too, and the global token normaliser counts the same units both ways. For grpo and online_ppo the whole first
minibatch runs, cut by train.micro_batch_tokens (ranks cut it differently; both run as many micro-batches) with
DeepSpeed's accumulation boundary marked as the loop marks it, and then the loop itself runs the step."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, launch_ranks

pytestmark = pytest.mark.slow

MODEL = """\
model:
  init: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 128, tie_word_embeddings: true}}
  dtype: fp32
tokenizer: {{build: {{kind: char}}}}
deepspeed: {{zero_stage: 0}}
runtime: {{progress_bar: false, tensorboard: false}}
output_dir: {folder}/{name}
"""

JOBS = {
    "seq": "data: {{path: {data}/text.jsonl, max_seq_len: 48}}\n"
    "train: {{train_type: seq, max_steps: 1, micro_batch_size: 1, seed: 7}}\n",
    "sft": "data: {{path: {data}/sft.jsonl, max_seq_len: 64, packing: true}}\n"
    "train: {{train_type: sft, max_steps: 1, micro_batch_tokens: 256, seed: 7}}\n",
    "dpo": "data: {{path: {data}/preference.jsonl, max_seq_len: 64, packing: true}}\n"
    "train: {{train_type: dpo, max_steps: 1, micro_batch_tokens: 256, seed: 7}}\n",
    "grpo": "data: {{path: {data}/prompts.jsonl, max_seq_len: 32}}\n"
    "rollout: {{prompts_per_step: 4, group_size: 4, max_new_tokens: 8}}\n"
    "rl: {{kl_coef: 0.05, packing: true, epochs_per_rollout: 2}}\n"
    "reward: {{function: 'tests.integration.packing_rank_worker:length_reward'}}\n"
    "train: {{train_type: grpo, max_steps: 1, micro_batch_size: 4, grad_accum_steps: 2, micro_batch_tokens: 59, "
    "seed: 7}}\n",
    "online_ppo": "data: {{path: {data}/prompts.jsonl, max_seq_len: 32}}\n"
    "rollout: {{prompts_per_step: 4, group_size: 2, max_new_tokens: 8}}\n"
    "rl: {{kl_coef: 0.05, packing: true}}\n"
    "reward: {{function: 'tests.integration.packing_rank_worker:length_reward'}}\n"
    "train: {{train_type: online_ppo, max_steps: 1, micro_batch_size: 2, grad_accum_steps: 2, "
    "micro_batch_tokens: 59, seed: 7}}\n",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packing_ranks")
    runs = []
    for name, job in JOBS.items():
        config = folder / f"{name}.yaml"
        config.write_text(MODEL.format(folder=folder, name=name) + job.format(data=REPO / "data/arithmetic"))
        runs.append({"name": name, "config": str(config)})
    # grpo's step again under ZeRO-3, through the loop only: the ranks' token cuts differ (7 and 6 micro-batches
    # in the equivalence run), and every forward and backward gathers the partitioned weights on both ranks
    zero3 = ["deepspeed.zero_stage=3", f"output_dir={folder / 'grpo_zero3'}"]
    runs.append({"name": "grpo_zero3", "config": str(folder / "grpo.yaml"), "set": zero3, "loop_only": True})
    plan, results = folder / "plan.json", folder / "results.json"
    plan.write_text(json.dumps({"results": str(results), "runs": runs}))
    completed = launch_ranks([REPO / "tests/integration/packing_rank_worker.py", "--plan", plan], 2, 900)
    assert completed.returncode == 0, f"{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}"
    return json.loads(results.read_text())


def test_packed_grpo_step_under_zero3_runs_its_optimizer_steps(report):
    loop = report["grpo_zero3"]["loop"]
    assert loop["optimizer_steps"] == loop["expected"] == 2, loop  # 2 replay epochs of one minibatch
    assert loop["zero_stage"] == 3, loop


@pytest.mark.parametrize("train_type", list(JOBS))
def test_packed_equals_padded_on_two_ranks(report, train_type):
    summary = report[train_type]
    parts = ("policy", "critic") if train_type == "online_ppo" else ("policy",)
    assert set(summary) - {"targets", "attention", "micro_batches", "tokens", "loop"} == set(parts)
    # with packing the policy runs sdpa one row at a time; seq's document mask takes transformers' mask path
    assert summary["attention"] == ("sdpa" if train_type == "seq" else "astrai_segment_sdpa")
    for part in parts:
        result = summary[part]
        padded_weight, packed_weight = result["weights"]
        assert padded_weight == packed_weight > 0, result  # the global normaliser counts the same units
        assert result["loss"] < 1e-5 and result["loss_value"] != 0, result
        assert result["gradients"] < 1e-5 < result["gradient_scale"], result
    if train_type in ("grpo", "online_ppo"):
        assert summary["targets"] < 1e-5, summary
        # rl.packing cuts a minibatch by train.micro_batch_tokens: every rank runs as many micro-batches (one
        # with fewer tokens pads with an empty one), and the loop's DeepSpeed steps land where they should
        counts = summary["micro_batches"]
        assert [total for _, total in counts["padded"]] == [2, 2], counts  # grad_accum_steps
        totals = {total for _, total in counts["packed"]}
        assert len(totals) == 1 and totals != {2}, (counts, summary["tokens"])
        # the ranks' cuts differ (their sequence lengths make train.micro_batch_tokens 59 fit a pair on one
        # rank only): the rank with fewer ran an empty micro-batch, and the loss and gradients above still match
        assert any(with_tokens < total for with_tokens, total in counts["packed"]), (counts, summary["tokens"])
        loop = summary["loop"]
        assert loop["optimizer_steps"] == loop["expected"] > 0, loop
