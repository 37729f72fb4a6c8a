"""Masked reductions against hand arithmetic and Python's `statistics` module."""

import math
import statistics

import pytest
import torch

from astrai.algos.masked import masked_aggregate, masked_mean, masked_sum, masked_var, masked_whiten, rows_with_tokens

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # valid: 1, 2 | 4


def test_masked_sum_and_mean_by_hand():
    assert masked_sum(VALUES, MASK).item() == 7.0  # 1 + 2 + 4
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7.0 / 3.0)
    assert masked_sum(VALUES, MASK, dim=-1).tolist() == [3.0, 4.0]
    assert masked_mean(VALUES, MASK, dim=-1).tolist() == [1.5, 4.0]
    assert masked_mean(VALUES, MASK, dim=0).tolist() == [2.5, 2.0, 0.0]  # (1+4)/2, 2/1, empty column -> 0


def test_bool_and_float_masks_agree():
    assert torch.equal(masked_mean(VALUES, MASK), masked_mean(VALUES, MASK.bool()))
    assert torch.equal(masked_var(VALUES, MASK), masked_var(VALUES, MASK.bool()))


def test_empty_mask_gives_zero_and_finite_gradient():
    values = torch.randn(2, 3, requires_grad=True)
    empty = torch.zeros(2, 3)
    mean = masked_mean(values, empty)
    assert mean.item() == 0.0
    mean.backward()
    assert torch.equal(values.grad, torch.zeros(2, 3))
    assert masked_mean(values, empty, dim=-1).tolist() == [0.0, 0.0]
    assert masked_var(values, empty).item() == 0.0


def test_junk_in_padding_reaches_neither_value_nor_gradient():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), float("-inf")]], requires_grad=True)
    mean = masked_mean(values, MASK)
    assert mean.item() == pytest.approx(7.0 / 3.0)
    mean.backward()
    assert torch.allclose(values.grad, MASK / 3.0)


def test_masked_var_against_statistics_module():
    # valid 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 14/3
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(14.0 / 9.0)  # / 3
    assert masked_var(VALUES, MASK, unbiased=True).item() == pytest.approx(14.0 / 6.0)  # / 2
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(4, 9, generator=generator, dtype=torch.float64)
    mask = torch.rand(4, 9, generator=generator) > 0.4
    kept = [v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    assert masked_var(values, mask).item() == pytest.approx(statistics.variance(kept))
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(statistics.pvariance(kept))


def test_masked_var_with_one_valid_entry_is_zero():
    one = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_var(VALUES, one, unbiased=True).item() == 0.0
    assert masked_var(VALUES, one, unbiased=False).item() == 0.0


def test_masked_whiten_by_hand():
    whitened = masked_whiten(VALUES, MASK)
    scale = math.sqrt(7.0 / 3.0 + 1e-8)  # unbiased var of 1, 2, 4 is 7/3
    expected = torch.tensor([[(1 - 7 / 3) / scale, (2 - 7 / 3) / scale, 0.0], [(4 - 7 / 3) / scale, 0.0, 0.0]])
    assert torch.allclose(whitened, expected)
    assert masked_mean(whitened, MASK).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(whitened, MASK).item() == pytest.approx(1.0, abs=1e-6)
    kept_mean = masked_whiten(VALUES, MASK, shift_mean=False)
    assert torch.allclose(kept_mean, torch.where(MASK.bool(), expected + 7.0 / 3.0, torch.zeros(())))


def test_aggregate_by_hand():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # third row empty
    assert masked_aggregate(losses, mask, "token_mean").item() == pytest.approx(10.0 / 4.0)
    assert masked_aggregate(losses, mask, "sequence_mean").item() == pytest.approx((2.0 + 4.0) / 2.0)
    assert masked_aggregate(losses, mask, "global", global_token_count=8).item() == pytest.approx(10.0 / 8.0)
    count = torch.tensor(5.0)
    assert masked_aggregate(losses, mask, "global", global_token_count=count).item() == pytest.approx(2.0)


def test_aggregate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        masked_aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match="needs global_token_count"):
        masked_aggregate(VALUES, MASK, "global")
    with pytest.raises(ValueError, match="must be > 0"):
        masked_aggregate(VALUES, MASK, "global", global_token_count=0)
    with pytest.raises(ValueError, match="only used with"):
        masked_aggregate(VALUES, MASK, "token_mean", global_token_count=3)


def test_global_sequence_counts_only_rows_with_tokens():
    """verl's seq-mean-token-mean with a global batch size: per-row token means summed over rows that
    have a token, divided by the global count of such rows; an empty row counts nowhere (float64 loop)."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(8, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    lengths = [3, 0, 5, 1, 0, 2, 4, 5]  # ragged, two empty rows
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
    expected = 0.0
    for row, length in enumerate(lengths):
        if length:
            expected = expected + sum(values[row, t] for t in range(length)) / length
    expected = expected / sum(1 for length in lengths if length)
    aggregated = masked_aggregate(values, mask, "global_sequence", global_sequence_count=6)
    assert aggregated.item() == pytest.approx(expected.item(), abs=1e-12)
    (loop_gradient,) = torch.autograd.grad(expected, values)
    (gradient,) = torch.autograd.grad(aggregated, values)
    assert torch.allclose(gradient, loop_gradient, atol=1e-15) and gradient[1].abs().sum() == 0
    assert masked_aggregate(values, mask, "sequence_mean").item() == pytest.approx(expected.item(), abs=1e-12)
    assert rows_with_tokens(mask).tolist() == [n > 0 for n in lengths]
    # split over 2 x 2 pieces, each divided by the one global count: the pieces sum to the whole
    pieces = sum(
        masked_aggregate(values[rows], mask[rows], "global_sequence", global_sequence_count=6).item()
        for rows in (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8))
    )
    assert pieces == pytest.approx(expected.item(), abs=1e-12)
    with pytest.raises(ValueError, match="needs global_sequence_count"):
        masked_aggregate(values, mask, "global_sequence")
    with pytest.raises(ValueError, match="global_sequence_count is only used with aggregation 'global_sequence'"):
        masked_aggregate(values, mask, "global", 3, global_sequence_count=6)
