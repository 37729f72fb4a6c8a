"""The prompt + response layout (astrai/rollout/sequences.py): response masks through the first EOS, left
padding, joined sequences and their position ids; and the plain scoring forward (astrai/rollout/scoring.py),
which asks the model for the logits of the last R + 1 columns only (`logits_to_keep`) and must give exactly
what slicing a full forward gives, with or without a model that takes the option."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.algos.logprobs import token_logprobs
from astrai.rollout.scoring import PlainForward, keeps_logits
from astrai.rollout.sequences import join_sequences, left_pad, position_ids, response_mask, truncated_rows
from tests.unit.rollout_fixtures import LLAMA_SHAPE

EOS, PAD = 3, 0


def test_response_mask_keeps_tokens_through_the_first_eos():
    responses = torch.tensor(
        [
            [5, 6, EOS, PAD, PAD],  # EOS in the middle: the EOS is kept, the padding after it is not
            [EOS, EOS, EOS, EOS, EOS],  # all EOS (pad == eos tokenizers): only the first counts
            [5, 6, 7, 8, 9],  # no EOS: cut at max length, every token kept
            [EOS, 5, 6, EOS, 7],  # immediate EOS: whatever follows is junk
            [5, 6, 7, 8, EOS],  # EOS exactly at the last column
        ]
    )
    assert response_mask(responses, EOS).tolist() == [
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
    ]
    assert truncated_rows(responses, EOS).tolist() == [False, False, True, False, False]
    assert response_mask(torch.tensor([[5, 9, 6]]), [9, EOS]).tolist() == [[1, 1, 0]]  # several stop ids


def test_left_pad_join_and_positions():
    prompt_ids, prompt_mask = left_pad([[11, 12, 13], [21]], PAD)
    assert prompt_ids.tolist() == [[11, 12, 13], [PAD, PAD, 21]]
    assert prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    response_ids = torch.tensor([[5, EOS, PAD], [6, 7, 8]])
    joined = join_sequences(prompt_ids, prompt_mask, response_ids, response_mask(response_ids, EOS))
    assert joined["input_ids"].tolist() == [[11, 12, 13, 5, EOS, PAD], [PAD, PAD, 21, 6, 7, 8]]
    assert joined["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    # Positions count attended tokens only: the short prompt's first real token is position 0.
    assert joined["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert position_ids(torch.tensor([[0, 1, 1, 0]])).tolist() == [[0, 0, 1, 1]]
    # Prompt masking: the loss mask covers response columns only; prompt tokens are never trained.
    assert joined["response_mask"].shape == (2, 3) and joined["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


class NoKeepOption(torch.nn.Module):
    """A causal LM whose forward takes no `logits_to_keep` (older or custom models)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


# The 2-layer, 40-token Llama the scoring-forward tests build (seeded by each test).
SCORING_LLAMA = LlamaConfig(vocab_size=40, **LLAMA_SHAPE)


def test_response_logits_with_logits_to_keep_equal_a_sliced_full_forward():
    torch.manual_seed(0)
    model = LlamaForCausalLM(SCORING_LLAMA).eval()
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], pad_token_id=0)
    response_ids = torch.randint(3, 40, (3, 6))
    response_ids[1, 2] = 2  # an EOS mid-response: the mask ends there
    sequences = join_sequences(prompt_ids, prompt_mask, response_ids, response_mask(response_ids, 2))
    assert keeps_logits(model) and not keeps_logits(NoKeepOption(model))
    with torch.no_grad():
        full = model(
            input_ids=sequences["input_ids"],
            attention_mask=sequences["attention_mask"],
            position_ids=sequences["position_ids"],
        ).logits
        expected = full[:, 4:10] / 0.7  # P = 5: response token t is predicted at column P - 1 + t
        kept = PlainForward(temperature=0.7).logits(model, sequences)[0]
        sliced = PlainForward(temperature=0.7).logits(NoKeepOption(model), sequences)[0]
    assert kept.shape == (3, 6, 40)
    torch.testing.assert_close(kept, expected, rtol=0, atol=1e-6)  # the same matmuls on fewer rows
    torch.testing.assert_close(sliced, expected, rtol=0, atol=0)


def test_scoring_forwards_build_no_cache_and_give_the_cached_forwards_logits():
    """The plain forward's logits and token_statistics (full and chunked) pass use_cache=False: no key/value cache
    is built (the model's default would fill one), and the log-probs are those of the default forward."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(SCORING_LLAMA).eval()
    assert model.config.use_cache  # the default this forward overrides
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8, 9], [10, 11]], pad_token_id=0)
    response_ids = torch.randint(3, 40, (2, 4))
    sequences = join_sequences(prompt_ids, prompt_mask, response_ids, response_mask(response_ids, 2))
    with torch.no_grad():
        default = model(
            input_ids=sequences["input_ids"],
            attention_mask=sequences["attention_mask"],
            position_ids=sequences["position_ids"],
        )
        assert default.past_key_values is not None
        logits, output = PlainForward().logits(model, sequences)
        assert output.past_key_values is None
        torch.testing.assert_close(logits, default.logits[:, 4:8], rtol=0, atol=1e-6)
        expected = token_logprobs(default.logits[:, 4:8], response_ids)
        mask = sequences["response_mask"].bool()
        for chunk_size in (0, 3):  # the full logits, and the chunked output layer
            logprobs, _, output = PlainForward(chunk_size=chunk_size).token_statistics(model, sequences)
            assert output.past_key_values is None
            torch.testing.assert_close(logprobs[mask], expected[mask], rtol=0, atol=1e-5)
