"""Architecture matrix: sft -> export -> grpo for ten transformers families, in one launch per rank count.

For each architecture a tiny model is built from a `model.init` block with the char tokenizer of the
shipped arithmetic chats (as configs/quickstart.yaml does): one sft step (ZeRO-2 on 2 ranks, ZeRO-3 on 1)
that publishes a checkpoint and exports it on finish (`export.on_finish`, astrai.export.hf on rank 0), then one grpo
step that starts from that export (`model.path`) with a tiny rollout. The test process then checks that the
exported folder, loaded with plain `AutoModelForCausalLM.from_pretrained`, gives the logits of the
checkpoint's consolidated weights loaded into the model `build_policy` builds (independent of the export
code), and that the grpo step's metrics are finite with a real gradient. Both jobs compute their log-probs
in chunks of a few positions (`train.logits_chunk_size`), so every architecture also trains through the
chunked path under ZeRO-2 and ZeRO-3 (its exactness: tests/unit/models/test_output_head.py). Every architecture
shares the launch of its rank count (a launch costs 10-20 s of imports), so the whole matrix stays within CI's time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import REPO
from tests.integration.plan import launch_plan, metrics
from tests.integration.test_export_ranks import logits_of, trained_model, zero_stage_written

pytestmark = pytest.mark.slow

# (ranks, sft ZeRO stage) of each launch: the 2-rank one shards gradients, the 1-rank one shards parameters.
LAUNCHES = {"2ranks_zero2": (2, 2), "1rank_zero3": (1, 3)}
LAYERS = {"num_hidden_layers": 2, "max_position_embeddings": 64}
ATTENTION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, **LAYERS}
# model.init blocks; every field is a field of that model_type's transformers config. head_dim is set
# where the config's default (Qwen3 128, Gemma 256) would not follow hidden_size / heads.
ARCHITECTURES = {
    "llama": {"model_type": "llama", **ATTENTION},
    "qwen2_tied": {"model_type": "qwen2", **ATTENTION, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", **ATTENTION, "head_dim": 8},
    "mistral": {"model_type": "mistral", **ATTENTION},
    "gemma": {"model_type": "gemma", **ATTENTION, "head_dim": 8},
    "phi3": {"model_type": "phi3", **ATTENTION},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_inner": 64, "n_layer": 2, "n_head": 4, "n_positions": 64},
    "gpt_neox": {
        "model_type": "gpt_neox",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        **LAYERS,
    },
    "opt": {
        "model_type": "opt",
        "hidden_size": 32,
        "ffn_dim": 64,
        "word_embed_proj_dim": 32,
        "num_attention_heads": 4,
        **LAYERS,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        **ATTENTION,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
    },
}

SFT_JOB = """\
output_dir: {folder}/{name}_sft
model: {{init: {init}}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {folder}/sft.jsonl, max_seq_len: 32}}
train: {{train_type: sft, max_steps: 1, micro_batch_size: 2, lr: 5e-3, lr_schedule: constant, warmup_steps: 0,
        seed: 7, logits_chunk_size: 16}}
deepspeed: {{zero_stage: {zero_stage}}}
runtime: {{progress_bar: false, tensorboard: false}}
export: {{hf_dir: {folder}/{name}_hf, on_finish: true}}
"""

GRPO_JOB = """\
output_dir: {folder}/{name}_grpo
model: {{path: {folder}/{name}_hf}}
data: {{path: {folder}/prompts.jsonl, max_seq_len: 32}}
rollout: {{prompts_per_step: {ranks}, group_size: 2, max_new_tokens: 4}}
reward: {{function: "tests.integration.test_architectures:character_code_reward"}}
train: {{train_type: grpo, max_steps: 1, micro_batch_size: 2, lr: 1e-3, lr_schedule: constant, warmup_steps: 0,
        seed: 7, logits_chunk_size: 4}}
deepspeed: {{zero_stage: 2}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


def character_code_reward(responses: list[str]) -> list[float]:
    """A reward that differs between any two different responses (sum of character codes mod 97), so a group's
    advantages are not all 0 and the grpo step sends a real gradient through the architecture (an untrained
    model scores 0 on the arithmetic verifier, which would make the step a no-op)."""
    return [float(sum(map(ord, response)) % 97) for response in responses]


GRPO_FIELDS = ("reward_mean", "reward_std", "kl", "clip_frac", "entropy", "response_len_mean", "loss", "grad_norm")


@pytest.fixture(scope="module", params=list(LAUNCHES))
def launched(request, tmp_path_factory) -> tuple[Path, dict, int, int]:
    """(folder, rank 0's results, ranks, sft ZeRO stage) of the one launch running every architecture's sft and grpo."""
    ranks, zero_stage = LAUNCHES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    # The whole shipped chat file for the sft data: the char tokenizer is built from it, and every
    # character of the prompts must be in it.
    (folder / "sft.jsonl").write_text((REPO / "data/arithmetic/sft.jsonl").read_text())
    prompts = (REPO / "data/arithmetic/prompts.jsonl").read_text().splitlines(keepends=True)[:8]
    (folder / "prompts.jsonl").write_text("".join(prompts))
    runs = []
    for name, init in ARCHITECTURES.items():
        sft, grpo = folder / f"{name}_sft.yaml", folder / f"{name}_grpo.yaml"
        sft.write_text(SFT_JOB.format(folder=folder, name=name, init=json.dumps(init), zero_stage=zero_stage))
        grpo.write_text(GRPO_JOB.format(folder=folder, name=name, ranks=ranks))
        runs += [{"name": f"{name}_sft", "config": str(sft)}, {"name": f"{name}_grpo", "config": str(grpo)}]
    return folder, launch_plan(folder, runs, ranks=ranks), ranks, zero_stage


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_sft_step_exports_the_checkpoints_logits(name, launched):
    folder, results, ranks, zero_stage = launched
    assert results[f"{name}_sft"] == {"ok": True, "error": None, "step": 1}, results[f"{name}_sft"]
    checkpoint = folder / f"{name}_sft" / "checkpoints" / "step_00000001"
    assert json.loads((checkpoint / "manifest.json").read_text())["world_size"] == ranks
    # Sharded as asked: a stage silently falling back would leave the ZeRO-3 consolidation untested.
    assert zero_stage_written(checkpoint) == zero_stage
    reference = trained_model(checkpoint)
    loaded = AutoModelForCausalLM.from_pretrained(folder / f"{name}_hf", dtype=torch.float32).eval()
    assert loaded.config.model_type == ARCHITECTURES[name]["model_type"]
    assert type(loaded) is type(reference)
    vocab_size = reference.config.vocab_size
    expected = logits_of(reference, vocab_size)
    torch.testing.assert_close(logits_of(loaded, vocab_size), expected, atol=1e-5, rtol=0)
    # The comparison means something only if the step moved the weights away from their initial values.
    from astrai.config import load_job
    from astrai.models.policy import build_policy
    from astrai.models.tokenizer import load_tokenizer

    job = load_job(checkpoint / "job.yaml", check_paths=False)
    initial = build_policy(job.model, load_tokenizer(str(folder / f"{name}_sft" / "tokenizer")), job.train.seed).eval()
    assert (logits_of(initial, vocab_size) - expected).abs().max().item() > 1e-3
    if name == "qwen2_tied":
        assert loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_grpo_step_from_the_export_has_finite_metrics(name, launched):
    folder, results, ranks, _ = launched
    assert results[f"{name}_grpo"] == {"ok": True, "error": None, "step": 1}, results[f"{name}_grpo"]
    (record,) = metrics(folder, f"{name}_grpo")
    assert record["step"] == 1 and record["samples"] == ranks  # prompts consumed
    for field in GRPO_FIELDS:
        assert isinstance(record[field], int | float) and math.isfinite(record[field]), (field, record)
    assert record["kl"] == pytest.approx(0.0, abs=1e-6)  # the first update starts from the reference
    assert record["reward_std"] > 0 and record["grad_norm"] > 0  # the step had advantages to follow
