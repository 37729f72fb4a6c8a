"""A model whose output layer has more rows (64) than its tokenizer has tokens (a char tokenizer built from
the data): no sampled id is out of the tokenizer's range, and every log-prob the losses and the behaviour
use renormalises over the real vocabulary (checked against log_softmax of the first len(tokenizer)
logits, computed here). Without the cut the same model does draw ids the tokenizer cannot decode.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.algos.logprobs import real_vocabulary, token_logprobs
from astrai.config import load_job
from astrai.models.tokenizer import build_tokenizer
from astrai.rollout.generation import generate_rollout, sample_responses
from astrai.rollout.prompts import Prompts, render_prompt
from astrai.rollout.sequences import join_sequences, left_pad
from astrai.rollout.token_sampler import TokenSampler
from astrai.strategies.dpo import completion_logprobs
from astrai.training.build import build_run
from astrai.training.loops import train_online
from tests.conftest import REPO
from tests.unit.rollout_fixtures import LLAMA_SHAPE, PlainEngine, behaviour_scoring
from tests.unit.strategies.test_grpo import job

MODEL_ROWS = 64


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("char", ["0123456789+-="])


@pytest.fixture(scope="module")
def model(tokenizer):
    assert len(tokenizer) < MODEL_ROWS / 2  # most output rows are padding
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=MODEL_ROWS,
        **LLAMA_SHAPE,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


def by_hand(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax over the first vocab_size logits, read at ids: [..., vocab] -> [...], float64."""
    return torch.log_softmax(logits[..., :vocab_size].double() / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)


def test_real_vocabulary_is_a_view_and_token_logprobs_renormalise_over_it():
    logits = torch.randn(2, 5, MODEL_ROWS, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(1))
    cut = real_vocabulary(logits, 20)
    assert cut.shape == (2, 5, 20) and cut.data_ptr() == logits.data_ptr()  # no copy
    assert real_vocabulary(logits, None) is logits and real_vocabulary(logits, MODEL_ROWS) is logits
    logprobs = token_logprobs(cut, labels)
    assert torch.allclose(logprobs.double(), by_hand(logits, labels, 20), atol=1e-6)
    every_id = token_logprobs(
        cut[:, :, None].expand(2, 5, 20, 20).reshape(2, 100, 20), torch.arange(20).repeat(2, 5, 1).reshape(2, 100)
    )
    assert torch.allclose(
        every_id.exp().reshape(2, 5, 20).sum(-1), torch.ones(2, 5)
    )  # a distribution over the 20 real ids


def test_the_token_sampler_never_draws_a_padded_id_and_keeps_real_vocabulary_logprobs():
    logits = torch.zeros(4000, MODEL_ROWS)
    logits[:, :20] = torch.arange(20) / 10  # distinct, so that top_k keeps exactly k
    logits[:, 20:] = 5.0  # padded rows more likely than every real token
    torch.manual_seed(0)
    unmasked = TokenSampler(1.0, 0, 1.0, keep_logprobs=False)(
        torch.zeros(4000, 1, dtype=torch.long), logits.clone()
    ).argmax(-1)
    assert (unmasked >= 20).float().mean() > 0.9  # what the issue saw: ids the tokenizer does not have
    for knobs in ({"temperature": 1.0, "top_k": 0, "top_p": 1.0}, {"temperature": 0.7, "top_k": 5, "top_p": 1.0}):
        sampler = TokenSampler(**knobs, keep_logprobs=True, vocab_size=20)
        chosen = sampler(torch.zeros(4000, 1, dtype=torch.long), logits.clone())
        tokens = chosen.argmax(-1)
        assert chosen.shape == (4000, MODEL_ROWS) and tokens.max() < 20
        assert len(tokens.unique()) == (20 if knobs["top_k"] == 0 else 5)
        kept = sampler.logprobs(tokens[:, None], torch.ones(4000, 1))[:, 0]
        assert torch.allclose(kept.double(), by_hand(logits, tokens, 20, knobs["temperature"]), atol=1e-6)


@pytest.mark.parametrize("source", ["recompute", "sampler"])
def test_rollouts_sample_only_real_ids_and_their_behaviour_logprobs_renormalise(model, tokenizer, source):
    vocab = len(tokenizer)
    chats = [[{"role": "user", "content": text}] for text in ("1+2=", "30-4=")]
    prompts = [render_prompt(tokenizer, chat) for chat in chats]
    settings = job(rollout={"group_size": 8, "max_new_tokens": 8, "behaviour_logprobs": source}).rollout
    # The model itself does sample padded ids: a third of its mass at the first step is on ids >= len(tokenizer).
    ids, mask = left_pad([prompts[0]] * 64, tokenizer.pad_token_id)
    with torch.no_grad():
        first = torch.softmax(model(input_ids=ids[:1], attention_mask=mask[:1]).logits[0, -1], -1)
    assert first[vocab:].sum() > 0.3
    torch.manual_seed(0)
    unmasked = sample_responses(
        PlainEngine(model), ids, mask, settings, tokenizer, TokenSampler(1.0, 0, 1.0, keep_logprobs=False)
    )
    assert (unmasked >= vocab).any()
    result = generate_rollout(
        PlainEngine(model),
        tokenizer,
        Prompts(prompts, chats, [{}, {}]),
        settings,
        seed=3,
        scoring=behaviour_scoring(settings, tokenizer, 4),
    )
    assert result.response_ids.max() < vocab
    # Every sampled id is a token the tokenizer has (it has none for the padded ones, so decoding drops them).
    assert None in tokenizer.convert_ids_to_tokens(unmasked.flatten().tolist())
    assert None not in tokenizer.convert_ids_to_tokens(result.response_ids.flatten().tolist())
    sequences = join_sequences(result.prompt_ids, result.prompt_mask, result.response_ids, result.response_mask)
    with torch.no_grad():
        logits = model(
            input_ids=sequences["input_ids"],
            attention_mask=sequences["attention_mask"],
            position_ids=sequences["position_ids"],
        ).logits
    prompt_len = result.prompt_ids.shape[1]
    expected = by_hand(logits[:, prompt_len - 1 : -1], result.response_ids, vocab) * result.response_mask
    assert torch.allclose(result.behaviour_logprobs.double(), expected, atol=1e-5)


def test_dpo_completion_logprobs_renormalise_over_the_real_vocabulary(model, tokenizer):
    ids = torch.tensor([[3, 4, 5, 6, 7], [3, 4, 8, 9, 10]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.tensor([[0, 0, 1, 1, 1]] * 2)}
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        got = completion_logprobs(model, batch, vocab_size=len(tokenizer))
        full = completion_logprobs(model, batch)
    expected = by_hand(logits[:, :-1], ids[:, 1:], len(tokenizer))[:, 1:].sum(-1)
    assert (
        torch.allclose(got.double(), expected, atol=1e-5) and (got > full).all()
    )  # padded ids took mass from the real ones


GRPO_JOB = """\
output_dir: {output_dir}
model:
  init: {{model_type: llama, vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
          num_attention_heads: 4,
          num_key_value_heads: 2, max_position_embeddings: 64}}
tokenizer: {{build: {{kind: char}}}}
data: {{path: {data}, max_seq_len: 32}}
rollout: {{prompts_per_step: 4, group_size: 2, max_new_tokens: 6}}
rl: {{kl_coef: 0.1}}
reward: {{function: "tests.unit.strategies.test_ppo_engines:digit_count"}}
train: {{train_type: grpo, max_steps: 2, micro_batch_size: 4, grad_accum_steps: 2, lr: 1e-3, lr_schedule: constant,
         warmup_steps: 0, seed: 5}}
runtime: {{progress_bar: false, tensorboard: false}}
"""


@pytest.mark.parametrize("zero_stage", [0, 3])  # ZeRO-3 samples from the engine's plain generation copy
def test_a_grpo_run_of_a_padded_model_trains_on_real_ids_only(one_rank, tmp_path, zero_stage):
    lines = (REPO / "data/arithmetic/prompts.jsonl").read_text().splitlines(keepends=True)[:8]
    (tmp_path / "prompts.jsonl").write_text("".join(lines))
    config = tmp_path / "grpo.yaml"
    config.write_text(GRPO_JOB.format(output_dir=tmp_path / "out", data=tmp_path / "prompts.jsonl"))
    run = build_run(load_job(config, [f"deepspeed.zero_stage={zero_stage}"]), one_rank, str(config))
    vocab = len(run.tokenizer)
    weight = run.engines["policy"].module.get_output_embeddings().weight
    assert getattr(weight, "ds_shape", weight.shape)[0] == 64 > vocab
    seen = []
    compute_loss = run.strategy.compute_loss

    def recording(engine, batch, normalizer):
        seen.append(batch)
        return compute_loss(engine, batch, normalizer)

    run.strategy.compute_loss = recording
    train_online(run)
    assert seen and all(int(batch["response_ids"].max()) < vocab for batch in seen)
    batch = seen[0]
    with torch.no_grad():  # the reference (the policy's starting weights) renormalised over the real ids
        logits = run.strategy.reference(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    response_len = batch["response_ids"].shape[1]
    expected = by_hand(logits[:, -response_len - 1 : -1], batch["response_ids"], vocab) * batch["response_mask"]
    assert torch.allclose(batch["reference_logprobs"].double(), expected, atol=1e-5)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    # Step 1's one update starts at the reference: k3 is 0 up to the rounding of two batch shapes' forwards
    # (k3(d) ~ d^2 / 2 for |d| < 1e-5 in fp32, so < 1e-10; an AMD EPYC gives 5.9e-16 where a Xeon gives 0).
    assert [record["step"] for record in records] == [1, 2] and 0.0 <= records[0]["kl"] < 1e-10
