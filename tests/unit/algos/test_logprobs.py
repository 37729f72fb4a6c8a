"""Token and sequence log-probs against a plain-Python softmax, and padding invariance."""

import math

import pytest
import torch

from astrai.algos.logprobs import sequence_logprobs, shift_for_next_token, token_logprobs


def reference_token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> list[list[float]]:
    """log softmax(logits)[label], one token at a time in Python floats."""
    result = []
    for row_logits, row_labels in zip(logits.tolist(), labels.tolist()):
        row = []
        for token_logits, label in zip(row_logits, row_labels):
            peak = max(token_logits)
            log_normaliser = peak + math.log(sum(math.exp(x - peak) for x in token_logits))
            row.append(token_logits[label] - log_normaliser)
        result.append(row)
    return result


def test_token_logprobs_match_plain_python():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=generator) * 4
    labels = torch.randint(0, 11, (3, 5), generator=generator)
    result = token_logprobs(logits, labels)
    assert result.shape == (3, 5) and result.dtype == torch.float32
    assert torch.allclose(result, torch.tensor(reference_token_logprobs(logits, labels)), atol=1e-5)


def test_two_token_vocabulary_by_hand():
    # logits (0, log 3): p = (1/4, 3/4)
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    result = token_logprobs(logits, torch.tensor([[0, 1]]))
    assert result[0].tolist() == pytest.approx([math.log(0.25), math.log(0.75)], abs=1e-6)


def test_negative_labels_give_zero():
    logits = torch.randn(1, 3, 4)
    result = token_logprobs(logits, torch.tensor([[1, -100, 2]]))
    assert result[0, 1].item() == 0.0
    assert result[0, 0].item() == pytest.approx(torch.log_softmax(logits[0, 0], -1)[1].item(), abs=1e-6)


def test_bfloat16_logits_are_upcast_to_float32():
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 4, 50, generator=generator) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 50, (2, 4), generator=generator)
    result = token_logprobs(logits, labels)
    assert result.dtype == torch.float32
    # exactly the float32 computation on the same (bfloat16-representable) numbers
    assert torch.allclose(result, token_logprobs(logits.float(), labels), atol=1e-6)


def test_gradient_matches_finite_differences():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[0, 4, -100], [2, 2, 1]])
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, labels), (logits,))


def test_shift_for_next_token_aligns_logits_with_the_following_token():
    logits = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    input_ids = torch.tensor([[5, 6, 7, 8], [1, 2, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
    shifted_logits, labels, label_mask = shift_for_next_token(logits, input_ids, mask)
    assert torch.equal(shifted_logits, logits[:, :3])
    assert labels.tolist() == [[6, 7, 8], [2, 0, 0]]
    assert label_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="shapes differ"):
        shift_for_next_token(logits, input_ids[:, :3], mask)


def test_sequence_logprobs_sums_masked_tokens():
    token_logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, float("nan"), -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert sequence_logprobs(token_logps, mask).tolist() == [-3.0, -0.5]


def test_padding_does_not_change_sequence_logprob_or_gradient():
    """One sequence alone vs right-padded in a batch beside a longer one, junk in the padding."""
    generator = torch.Generator().manual_seed(3)
    vocab = 13
    short_ids = torch.randint(0, vocab, (1, 5), generator=generator)
    short_logits = torch.randn(1, 5, vocab, generator=generator)
    short_mask = torch.tensor([[0, 0, 1, 1, 1]])  # 2 prompt tokens, 3 response tokens

    def score(logits, ids, mask):
        logits, labels, label_mask = shift_for_next_token(logits, ids, mask)
        return sequence_logprobs(token_logprobs(logits, labels), label_mask)

    alone_logits = short_logits.clone().requires_grad_(True)
    alone = score(alone_logits, short_ids, short_mask)
    alone.sum().backward()

    padded_length = 9
    junk_logits = torch.randn(1, padded_length - 5, vocab, generator=generator) * 1e4
    junk_ids = torch.tensor([[-100, 3, 12, 0]])  # an ignore index and arbitrary ids
    long_logits = torch.randn(1, padded_length, vocab, generator=generator)
    long_ids = torch.randint(0, vocab, (1, padded_length), generator=generator)
    batch_logits = torch.cat([torch.cat([short_logits, junk_logits], dim=1), long_logits]).requires_grad_(True)
    batch_ids = torch.cat([torch.cat([short_ids, junk_ids], dim=1), long_ids])
    batch_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1, 1]])
    batched = score(batch_logits, batch_ids, batch_mask)
    batched.sum().backward()

    assert batched[0].item() == pytest.approx(alone.item(), abs=1e-6)
    assert torch.allclose(batch_logits.grad[0, :5], alone_logits.grad[0], atol=1e-6)
    assert torch.equal(batch_logits.grad[0, 5:], torch.zeros(padded_length - 5, vocab))
    expected = reference_token_logprobs(short_logits[:, :-1], short_ids[:, 1:])[0]
    assert alone.item() == pytest.approx(sum(expected[1:]), abs=1e-5)  # labels 2, 3, 4 are scored
