"""pass@k (Codex's unbiased estimator) against values computed by hand with binomials."""

from __future__ import annotations

from math import comb

import pytest
import torch

from astrai.algos.pass_at_k import pass_at_k


def by_hand(samples: int, correct: int, k: int) -> float:
    return 1.0 - comb(samples - correct, k) / comb(samples, k)


def test_hand_computed_cases():
    # n=5, k=2: c=0 -> 0; c=1 -> 1 - C(4,2)/C(5,2) = 1 - 6/10 = 0.4; c=2 -> 1 - 3/10 = 0.7; c=4 -> 1 (n - c < k).
    values = pass_at_k(torch.tensor([0, 1, 2, 4, 5]), samples=5, k=2)
    assert values.tolist() == pytest.approx([0.0, 0.4, 0.7, 1.0, 1.0], abs=1e-12)


def test_pass_at_1_is_the_fraction_correct():
    correct = torch.tensor([0, 3, 7, 10])
    assert pass_at_k(correct, samples=10, k=1).tolist() == pytest.approx([0.0, 0.3, 0.7, 1.0], abs=1e-12)


@pytest.mark.parametrize("samples", [1, 4, 16, 50])
def test_every_count_matches_the_binomials(samples):
    for k in range(1, samples + 1):
        correct = torch.arange(samples + 1)
        expected = [by_hand(samples, c, k) for c in range(samples + 1)]
        assert pass_at_k(correct, samples, k).tolist() == pytest.approx(expected, abs=1e-9)


def test_bad_arguments():
    with pytest.raises(ValueError, match="1 <= k <= samples"):
        pass_at_k(torch.tensor([1]), samples=2, k=3)
    with pytest.raises(ValueError, match="0..4"):
        pass_at_k(torch.tensor([5]), samples=4, k=1)
