"""`train.logits_chunk_size`: the sft loss, dpo completion log-probs, response log-probs and entropy computed
chunk by chunk from the hidden states (models/output_head.py) equal the full-logits path, values and
gradients, on tiny models of every architecture of the matrix, a tied and a padded vocabulary; models that
change their logits after the output layer are refused, named, and computed from the full logits."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from astrai.config.schema import JobConfig
from astrai.models.output_head import chunked_token_statistics, chunking_refusal, next_token_labels
from astrai.models.policy import disable_dropout
from astrai.rollout.scoring import PlainForward
from astrai.rollout.sequences import join_sequences
from astrai.strategies.dpo import completion_forward
from astrai.strategies.language_modeling import SftStrategy
from tests.integration.test_architectures import ARCHITECTURES

EXACT = {"rtol": 1e-6, "atol": 1e-6}
VOCAB = 72
CHUNK = 5
EXTRA = {
    # a model vocabulary padded past the tokenizer's 64 ids is cut by vocab_size below
    "llama_padded": {"model_type": "llama", **{k: v for k, v in ARCHITECTURES["llama"].items() if k != "model_type"}},
    "gemma2_softcap": {
        "model_type": "gemma2",
        **{k: v for k, v in ARCHITECTURES["gemma"].items() if k != "model_type"},
        "final_logit_softcapping": 30.0,
    },
    "granite_scaled": {
        "model_type": "granite",
        **{k: v for k, v in ARCHITECTURES["llama"].items() if k != "model_type"},
        "logits_scaling": 4.0,
    },
}
CHUNKED = sorted(ARCHITECTURES) + ["llama_padded"]
REFUSED = {"gemma2_softcap": "gemma2 applies final logit softcapping", "granite_scaled": "granite changes its logits"}


def tiny(name: str) -> torch.nn.Module:
    settings = dict({**ARCHITECTURES, **EXTRA}[name])
    special = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    config = AutoConfig.for_model(settings.pop("model_type"), vocab_size=VOCAB, **special, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # logits of a few units, as a trained model's, so fp32 rounding stays < 1e-6
        model.get_output_embeddings().weight.mul_(3.0 if model.config.tie_word_embeddings else 1.0)
    disable_dropout(model)
    return model.train()


def sft_job(chunk_size: int) -> JobConfig:
    return JobConfig.model_validate(
        {
            "output_dir": "/tmp/unused",
            "model": {"init": {"model_type": "llama"}},
            "tokenizer": {"build": {"kind": "char"}},
            "data": {"path": "unused.jsonl"},
            "train": {"train_type": "sft", "max_steps": 1, "logits_chunk_size": chunk_size},
        }
    )


def text_batch() -> dict:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 64, (3, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, 9:] = 0  # right padding
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[:, 4:] = 1
    loss_mask[2, 9:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def response_batch() -> dict:
    generator = torch.Generator().manual_seed(2)
    prompt_ids = torch.randint(1, 64, (3, 5), generator=generator)
    prompt_mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    prompt_ids = prompt_ids.masked_fill(~prompt_mask.bool(), 0)  # left padding
    response_ids = torch.randint(1, 64, (3, 6), generator=generator)
    response_mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    return join_sequences(prompt_ids, prompt_mask, response_ids, response_mask)


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same(full: dict, chunked: dict) -> None:
    assert full.keys() == chunked.keys() and full
    for name in full:
        # 1e-6 of the tensor's own scale: fp32 sums of many terms (a bias gradient) differ in their last bits
        # with the order of the output matmul and of the log-softmax, whatever their size
        scale = max(1.0, float(full[name].abs().max()))
        torch.testing.assert_close(chunked[name], full[name], rtol=1e-6, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("name", CHUNKED + sorted(REFUSED))
def test_sft_loss_and_gradients_equal_the_full_logits(name, caplog):
    model, batch = tiny(name), text_batch()
    results = []
    for chunk_size in (0, CHUNK):
        output = SftStrategy(sft_job(chunk_size), None).compute_loss(model, batch, normalizer=7.0)
        output.loss.backward()
        sums = {key: torch.tensor(value, dtype=torch.float64) for key, value in output.sums.items()}
        results.append(({"loss": output.loss.detach(), **sums}, gradients(model)))
    assert_same(results[0][0], results[1][0])
    assert_same(results[0][1], results[1][1])
    if name in REFUSED:
        assert REFUSED[name] in caplog.text


@pytest.mark.parametrize("name", CHUNKED)
def test_chunking_is_used_where_it_is_exact(name):
    model, batch = tiny(name), text_batch()
    labels = next_token_labels(batch["input_ids"], batch["loss_mask"])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    assert chunking_refusal(model) is None
    statistics = chunked_token_statistics(model, inputs, labels, chunk_size=CHUNK)
    assert statistics is not None and statistics.output.logits.shape == (3, 12, 1)  # no [3, 12, vocab] logits
    assert chunked_token_statistics(model, inputs, labels, chunk_size=36) is None  # 36 positions fit in one chunk


@pytest.mark.parametrize("name", CHUNKED + sorted(REFUSED))
def test_response_logprobs_entropy_and_gradients_equal_the_full_logits(name):
    model, sequences = tiny(name), response_batch()
    vocab_size = 64 if name == "llama_padded" else None
    weights = torch.linspace(-1.0, 1.0, 18).view(3, 6)
    results = []
    for chunk_size in (0, CHUNK):
        scoring = PlainForward(temperature=0.7, vocab_size=vocab_size, chunk_size=chunk_size)
        logprobs, entropy, output = scoring.token_statistics(model, sequences, entropy="trained")
        mask = sequences["response_mask"].bool()
        entropy = torch.where(mask, entropy, 0)  # as every loss reads it: on response tokens only
        loss = (weights * logprobs.exp()).sum() - 0.1 * (weights.flip(1) * entropy).sum()
        if getattr(output, "aux_loss", None) is not None:
            loss = loss + output.aux_loss
        loss.backward()
        values = {"logprobs": logprobs.detach(), "entropy": entropy.detach()}
        results.append((values, gradients(model)))
    assert (results[0][0]["logprobs"][~sequences["response_mask"].bool()] == 0).all()
    assert_same(results[0][0], results[1][0])
    assert_same(results[0][1], results[1][1])


@pytest.mark.parametrize("name", ["qwen2_tied", "llama_padded", "gpt_neox"])
@pytest.mark.parametrize("average", [False, True])
def test_dpo_completion_logprobs_equal_the_full_logits(name, average):
    model, batch = tiny(name), text_batch()
    vocab_size = 64 if name == "llama_padded" else None
    results = []
    for chunk_size in (0, CHUNK):
        logps, _ = completion_forward(model, batch, average, vocab_size, chunk_size)
        (logps * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
        results.append(({"logps": logps.detach()}, gradients(model)))
    assert_same(results[0][0], results[1][0])
    assert_same(results[0][1], results[1][1])


def test_no_gradient_path_and_a_router_loss_are_kept():
    model, sequences = tiny("qwen2_moe"), response_batch()
    with torch.no_grad():
        options = {"entropy": "metric", "output_router_logits": True}
        full = PlainForward(chunk_size=0).token_statistics(model, sequences, **options)
        chunked = PlainForward(chunk_size=CHUNK).token_statistics(model, sequences, **options)
    assert chunked[2].logits.shape[-1] == 2  # statistics, not logits
    torch.testing.assert_close(chunked[0], full[0], **EXACT)
    torch.testing.assert_close(chunked[2].aux_loss, full[2].aux_loss, **EXACT)


def test_an_output_layer_that_is_not_a_plain_linear_is_refused(caplog):
    class Scaled(torch.nn.Linear):
        pass

    model = tiny("llama")
    head = model.lm_head
    model.lm_head = Scaled(head.in_features, head.out_features, bias=False)
    assert "Scaled, not a plain torch.nn.Linear" in chunking_refusal(model)
    batch = text_batch()
    labels = next_token_labels(batch["input_ids"], batch["loss_mask"])
    with caplog.at_level(logging.WARNING):
        assert chunked_token_statistics(model, {"input_ids": batch["input_ids"]}, labels, chunk_size=CHUNK) is None
    assert "train.logits_chunk_size" in caplog.text
