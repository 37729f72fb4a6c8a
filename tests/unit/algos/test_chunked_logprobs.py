"""Chunked log-probs and entropy from hidden states equal those of the full logits, values and gradients."""

from __future__ import annotations

import pytest
import torch

from astrai.algos.chunked_logprobs import head_statistics
from astrai.algos.logprobs import real_vocabulary, token_logprobs
from astrai.algos.ppo import entropy_from_logits

EXACT = {"rtol": 1e-6, "atol": 1e-6}


def full_statistics(hidden, weight, bias, labels, temperature, vocab_size):
    logits = real_vocabulary(torch.nn.functional.linear(hidden, weight, bias), vocab_size) / temperature
    return token_logprobs(logits[None], labels[None])[0], entropy_from_logits(logits[None])[0]


def leaves(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(13, 8, generator=generator, requires_grad=True)
    # scaled as a trained output layer's logits are (a few units): fp32 rounding of the matmul stays < 1e-6
    weight = (0.3 * torch.randn(40, 8, generator=generator)).requires_grad_()
    bias = torch.randn(40, generator=generator, requires_grad=True)
    labels = torch.randint(0, 33, (13,), generator=generator)
    return hidden, weight, bias, labels


@pytest.mark.parametrize("chunk_size", [1, 4, 13, 100])
def test_values_and_gradients_equal_the_full_logits(chunk_size):
    # An arbitrary upstream gradient on both outputs (as a PPO ratio and an entropy bonus give).
    coefficients = torch.linspace(-1.0, 2.0, 13)
    results = []
    for chunked in (False, True):
        hidden, weight, bias, labels = leaves()
        if chunked:
            logps, entropy = head_statistics(
                hidden, weight, bias, labels, chunk_size=chunk_size, temperature=0.7, vocab_size=33, entropy="trained"
            )
        else:
            logps, entropy = full_statistics(hidden, weight, bias, labels, 0.7, 33)
        (coefficients * logps.exp()).sum().add((coefficients.flip(0) * entropy).sum()).backward()
        results.append((logps.detach(), entropy.detach(), hidden.grad, weight.grad, bias.grad))
    for full, chunked in zip(*results):
        torch.testing.assert_close(chunked, full, **EXACT)


def test_metric_entropy_has_no_gradient_and_no_graph_without_grad():
    hidden, weight, bias, labels = leaves()
    logps, entropy = head_statistics(hidden, weight, bias, labels, chunk_size=4, entropy="metric")
    assert logps.requires_grad and not entropy.requires_grad
    with torch.no_grad():
        logps, entropy = head_statistics(hidden, weight, None, labels, chunk_size=4)
    assert entropy is None and not logps.requires_grad and logps.dtype == torch.float32
    expected, _ = full_statistics(hidden.detach(), weight.detach(), None, labels, 1.0, None)
    torch.testing.assert_close(logps, expected, **EXACT)


def test_bfloat16_hidden_states_give_float32_statistics_as_the_full_path():
    hidden, weight, _, labels = leaves()
    hidden, weight = hidden.detach().bfloat16(), weight.detach().bfloat16()
    logps, entropy = head_statistics(hidden, weight, None, labels, chunk_size=5, temperature=0.5, entropy="metric")
    expected = full_statistics(hidden, weight, None, labels, 0.5, None)
    assert logps.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logps, expected[0], rtol=0, atol=0)  # row-wise math on the same bf16 logits
    torch.testing.assert_close(entropy, expected[1], rtol=0, atol=0)


def test_bad_arguments_are_refused():
    hidden, weight, bias, labels = leaves()
    with pytest.raises(ValueError, match="labels must be token ids >= 0"):
        head_statistics(hidden, weight, bias, labels - 100, chunk_size=4)
    with pytest.raises(ValueError, match="chunk_size"):
        head_statistics(hidden, weight, bias, labels, chunk_size=0)
    with pytest.raises(ValueError, match="entropy"):
        head_statistics(hidden, weight, bias, labels, chunk_size=4, entropy="yes")
